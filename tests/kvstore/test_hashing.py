"""Block hashing spec (docs/hashing.md): golden vectors and properties."""

import hashlib
import json
import struct
import subprocess
import sys

import pytest

from pagedserve.kvstore.hashing import (
    BlockHash,
    extend_block_hashes,
    hash_block,
    hash_blocks,
    model_fingerprint,
    model_fingerprint_from_dir,
)

FP = bytes(range(16))
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "torch_dtype": "float32",
    "transformers_version": "4.46.0",
}


def reference_chain(tokens: list[int], block_size: int, fp: bytes, salt: bytes) -> list[bytes]:
    """The spec written out byte by byte, independent of kvstore.hashing."""
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        block = struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size])
        if i == 0:
            head = (
                b"pagedserve/kv-block/v1"
                + struct.pack("<I", len(fp))
                + fp
                + struct.pack("<I", len(salt))
                + salt
            )
        else:
            head = hashes[-1]
        hashes.append(hashlib.sha256(head + block).digest()[:16])
    return hashes


# (fingerprint, salt, block_size, tokens, pinned hex hashes): the pinned hex is the real guard.
GOLDEN = [
    (
        FP,
        b"",
        4,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        ["0e23edf1ad149e3ea7acd1e573f28e20", "4f2a068ed248fe10642c03d3fabaab5f"],
    ),
    (
        FP,
        "tenant-a",
        4,
        [1, 2, 3, 4, 5, 6, 7, 8],
        ["f7680ed0e69b3684e751d7f368d0c4bc", "dd6054cbfc82d4496490f8a93ac35a7a"],
    ),
    (
        b"",
        b"",
        2,
        [0, 2**32 - 1, 128000, 7],
        ["a4364a90614f9447feb27bc81343ff2f", "0ed7a9fc47aae26c65a8112e264137b3"],
    ),
]


@pytest.mark.parametrize(("fp", "salt", "block_size", "tokens", "expected"), GOLDEN)
def test_golden_vectors_are_pinned(fp, salt, block_size, tokens, expected):
    hashes = hash_blocks(tokens, block_size, model_fingerprint=fp, cache_salt=salt)
    assert [h.hex() for h in hashes] == expected


@pytest.mark.parametrize(("fp", "salt", "block_size", "tokens", "expected"), GOLDEN)
def test_golden_vectors_match_byte_level_reference(fp, salt, block_size, tokens, expected):
    salt_bytes = salt.encode("utf-8") if isinstance(salt, str) else salt
    reference = reference_chain(tokens, block_size, fp, salt_bytes)
    assert [h.hex() for h in reference] == expected


def test_first_block_input_bytes_match_the_documented_example():
    data = (
        b"pagedserve/kv-block/v1"
        + (16).to_bytes(4, "little")
        + FP
        + (0).to_bytes(4, "little")
        + b"".join(t.to_bytes(4, "little") for t in [1, 2, 3, 4])
    )
    assert data.hex() == (
        "706167656473657276652f6b762d626c6f636b2f7631"
        "10000000"
        "000102030405060708090a0b0c0d0e0f"
        "00000000"
        "01000000020000000300000004000000"
    )
    assert hashlib.sha256(data).digest()[:16].hex() == "0e23edf1ad149e3ea7acd1e573f28e20"


def test_each_hash_chains_from_its_parent():
    tokens = list(range(100, 112))
    hashes = hash_blocks(tokens, 4, model_fingerprint=FP)
    assert len(hashes) == 3
    assert all(len(h) == 16 for h in hashes)
    assert hash_block(None, tokens[0:4], model_fingerprint=FP) == hashes[0]
    # NOTE: fingerprint and salt enter only the first block; later ones ignore them.
    assert hash_block(hashes[0], tokens[4:8], model_fingerprint=b"other") == hashes[1]
    assert hash_block(hashes[1], tokens[8:12], model_fingerprint=FP) == hashes[2]


def test_a_different_earlier_block_changes_every_later_hash():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, model_fingerprint=FP)
    b = hash_blocks([1, 2, 3, 9, 5, 6, 7, 8], 4, model_fingerprint=FP)
    assert a[0] != b[0]
    assert a[1] != b[1]


def test_same_prefix_gives_same_leading_hashes():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, model_fingerprint=FP)
    b = hash_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4, model_fingerprint=FP)
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_cache_salt_isolates_every_block():
    tokens = list(range(8))
    plain = hash_blocks(tokens, 4, model_fingerprint=FP)
    salted = hash_blocks(tokens, 4, model_fingerprint=FP, cache_salt="tenant-a")
    other = hash_blocks(tokens, 4, model_fingerprint=FP, cache_salt="tenant-b")
    assert len({*plain, *salted, *other}) == 6


def test_str_salt_is_its_utf8_bytes():
    tokens = list(range(8))
    as_str = hash_blocks(tokens, 4, model_fingerprint=FP, cache_salt="über")
    as_bytes = hash_blocks(tokens, 4, model_fingerprint=FP, cache_salt="über".encode())
    assert as_str == as_bytes


def test_length_prefixes_separate_fingerprint_from_salt():
    a = hash_block(None, [1], model_fingerprint=b"ab", cache_salt=b"c")
    b = hash_block(None, [1], model_fingerprint=b"a", cache_salt=b"bc")
    assert a != b


def test_fingerprint_changes_hashes():
    tokens = list(range(4))
    assert hash_blocks(tokens, 4, model_fingerprint=FP) != hash_blocks(
        tokens, 4, model_fingerprint=bytes(16)
    )


def test_partial_trailing_block_is_not_hashed():
    assert hash_blocks([1, 2, 3], 4, model_fingerprint=FP) == []
    assert len(hash_blocks(list(range(7)), 4, model_fingerprint=FP)) == 1
    assert hash_blocks(list(range(7)), 4, model_fingerprint=FP) == hash_blocks(
        list(range(4)), 4, model_fingerprint=FP
    )


def test_extend_one_token_at_a_time_equals_batch():
    tokens = [(7 * i) % 50 for i in range(23)]
    hashes: list[BlockHash] = []
    added_counts = []
    for n in range(len(tokens) + 1):
        added = extend_block_hashes(hashes, tokens[:n], 4, model_fingerprint=FP, cache_salt="s")
        added_counts.append(len(added))
    assert hashes == hash_blocks(tokens, 4, model_fingerprint=FP, cache_salt="s")
    assert sum(added_counts) == 5
    assert added_counts[4] == 1 and added_counts[5] == 0


def test_extend_returns_only_new_hashes_and_mutates_in_place():
    tokens = list(range(12))
    hashes = hash_blocks(tokens[:5], 4, model_fingerprint=FP)
    first = hashes
    added = extend_block_hashes(hashes, tokens, 4, model_fingerprint=FP)
    assert hashes is first
    assert added == hashes[1:]
    assert hashes == hash_blocks(tokens, 4, model_fingerprint=FP)


def test_extend_with_more_hashes_than_full_blocks_raises():
    hashes = hash_blocks(list(range(8)), 4, model_fingerprint=FP)
    with pytest.raises(ValueError, match="hashes"):
        extend_block_hashes(hashes, list(range(7)), 4, model_fingerprint=FP)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_id_out_of_uint32_range_raises(bad):
    with pytest.raises(ValueError, match=r"tokens\[2\]"):
        hash_blocks([1, 2, bad, 4], 4, model_fingerprint=FP)


def test_bad_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2, 3], 0, model_fingerprint=FP)


def test_bad_parent_raises():
    with pytest.raises(ValueError, match="parent"):
        hash_block(BlockHash(b"short"), [1], model_fingerprint=FP)


def test_fingerprint_is_pinned_and_ignores_volatile_keys():
    fp = model_fingerprint(TINY_CONFIG, dtype="bfloat16")
    assert fp.hex() == "0e8ea1bac1ae8896cc94a75ba463086f"
    resaved = {**TINY_CONFIG, "transformers_version": "9.9", "_name_or_path": "/x", "dtype": "f"}
    assert model_fingerprint(resaved, dtype="bfloat16") == fp


def test_fingerprint_matches_byte_level_reference():
    canonical = b'{"architectures":["LlamaForCausalLM"],"hidden_size":64,"num_hidden_layers":2}'
    data = b"pagedserve/model/v1"
    for part in (canonical, b"bfloat16", b""):
        data += struct.pack("<I", len(part)) + part
    assert hashlib.sha256(data).digest()[:16] == model_fingerprint(TINY_CONFIG, dtype="bfloat16")


def test_fingerprint_changes_with_dtype_config_and_revision():
    base = model_fingerprint(TINY_CONFIG, dtype="bfloat16")
    assert model_fingerprint(TINY_CONFIG, dtype="float16") != base
    assert model_fingerprint({**TINY_CONFIG, "hidden_size": 128}, dtype="bfloat16") != base
    assert model_fingerprint(TINY_CONFIG, dtype="bfloat16", revision="abc") != base


def test_fingerprint_normalizes_dtype_spelling():
    base = model_fingerprint(TINY_CONFIG, dtype="bfloat16")
    assert model_fingerprint(TINY_CONFIG, dtype="torch.bfloat16") == base
    assert model_fingerprint(TINY_CONFIG, dtype="bf16") == base


def test_fingerprint_from_dir_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    fp = model_fingerprint_from_dir(tmp_path, dtype="bfloat16")
    assert fp == model_fingerprint(TINY_CONFIG, dtype="bfloat16")


def test_fingerprint_from_dir_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        model_fingerprint_from_dir(tmp_path, dtype="bfloat16")


def test_importing_hashing_does_not_import_torch():
    code = "import sys, pagedserve.kvstore.hashing; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "pagedserve.kvstore.hashing imported torch"
