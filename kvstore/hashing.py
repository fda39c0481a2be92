"""Block hashing: the one spec (docs/hashing.md) shared by router, prefill and decode workers.

Torch-free on purpose: the router imports this module and must start without torch. Only the
standard library is used. The byte layout is specified in ``docs/hashing.md`` and pinned by golden
vectors in ``tests/kvstore/test_hashing.py``; change either and every prefix index entry written
by an older build becomes unreachable, so bump ``DOMAIN`` instead of editing the layout in place.

Chain (only full blocks are hashed)::

    h_0 = H(DOMAIN ‖ u32le(len(fp)) ‖ fp ‖ u32le(len(salt)) ‖ salt ‖ tokens_0)
    h_i = H(h_{i-1} ‖ tokens_i)

tokens as little-endian uint32, ``H`` = SHA-256 truncated to its first 16 bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NewType

BlockHash = NewType("BlockHash", bytes)
"""16 bytes identifying a full block *and* everything before it in its sequence."""

DOMAIN = b"pagedserve/kv-block/v1"
BLOCK_HASH_BYTES = 16

FINGERPRINT_DOMAIN = b"pagedserve/model/v1"
FINGERPRINT_BYTES = 16
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype"})
"""Config keys that change between saves of the same model and do not affect the KV contents."""

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
_MAX_TOKEN_ID = 2**32


def hash_block(
    parent: BlockHash | None,
    tokens: Sequence[int],
    *,
    model_fingerprint: bytes,
    cache_salt: str | bytes = b"",
) -> BlockHash:
    """Hash one full block given the hash of the block before it (``None`` for the first block).

    ``tokens`` must be exactly one full block; this function does not know the block size, so
    the caller guarantees it. ``model_fingerprint`` and ``cache_salt`` enter only the first block
    (``parent is None``); later blocks inherit them through ``parent``.

    Raises ValueError for an empty block, a token id outside ``[0, 2**32)`` or a parent that is
    not 16 bytes.
    """
    if len(tokens) == 0:
        raise ValueError("tokens: a block has at least one token, got an empty sequence")
    h = hashlib.sha256()
    if parent is None:
        h.update(_first_block_prefix(model_fingerprint, cache_salt))
    else:
        if not isinstance(parent, bytes) or len(parent) != BLOCK_HASH_BYTES:
            raise ValueError(f"parent: expected {BLOCK_HASH_BYTES} bytes, got {parent!r}")
        h.update(parent)
    h.update(_pack_tokens(tokens))
    return BlockHash(h.digest()[:BLOCK_HASH_BYTES])


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    model_fingerprint: bytes,
    cache_salt: str | bytes = b"",
) -> list[BlockHash]:
    """Return one hash per FULL block of ``token_ids``; a trailing partial block is not hashed."""
    hashes: list[BlockHash] = []
    extend_block_hashes(
        hashes,
        token_ids,
        block_size,
        model_fingerprint=model_fingerprint,
        cache_salt=cache_salt,
    )
    return hashes


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    *,
    model_fingerprint: bytes,
    cache_salt: str | bytes = b"",
) -> list[BlockHash]:
    """Append to ``hashes`` (in place) the hashes of blocks that became full since it was built.

    ``hashes`` must hold the hashes of the first ``len(hashes)`` blocks of ``token_ids`` (as made
    by an earlier call with a prefix of the same ``token_ids``, fingerprint and salt); that is
    not re-checked. Returns only the newly added hashes (possibly empty). Raises ValueError if
    ``hashes`` claims more full blocks than ``token_ids`` has.
    """
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    num_full = len(token_ids) // block_size
    if len(hashes) > num_full:
        raise ValueError(
            f"hashes: holds {len(hashes)} block hashes but token_ids has only {num_full} full "
            f"blocks of {block_size}"
        )
    parent = hashes[-1] if hashes else None
    added: list[BlockHash] = []
    for i in range(len(hashes), num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(
            parent, block, model_fingerprint=model_fingerprint, cache_salt=cache_salt
        )
        added.append(parent)
    hashes.extend(added)
    return added


def model_fingerprint(
    config: Mapping[str, Any], *, dtype: str, revision: str = "", weights: str = ""
) -> bytes:
    """Return 16 bytes naming the KV layout a model produces: its config, KV dtype, revision
    and, when quantized, how its weights are stored (``weights``, e.g. ``"int4-g128"``: the
    same prompt gives other K/V values, so other blocks).

    The volatile keys in ``VOLATILE_CONFIG_KEYS`` are dropped at every nesting level. ``dtype``
    is normalized (``"torch.bfloat16"`` and ``"bf16"`` both become ``"bfloat16"``) so that the
    router and workers agree however they spell it. Two checkpoints with the same config but
    different weights get the same fingerprint unless ``revision`` differs: pass a weight
    revision (commit, checksum) when that can happen.
    """
    canonical = json.dumps(
        _drop_volatile(config), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    ).encode("ascii")
    h = hashlib.sha256(FINGERPRINT_DOMAIN)
    parts = [canonical, normalize_dtype(dtype).encode("utf-8"), revision.encode("utf-8")]
    if weights:  # NOTE: only when quantized, so that every other fingerprint stays as it was
        parts.append(b"weights=" + weights.encode("utf-8"))
    for part in parts:
        h.update(_u32le(len(part)))
        h.update(part)
    return h.digest()[:FINGERPRINT_BYTES]


def model_fingerprint_from_dir(path: str | Path, *, dtype: str, revision: str = "") -> bytes:
    """``model_fingerprint`` of the ``config.json`` in a local Hugging Face model directory."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"path: {str(path)!r} has no config.json")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"path: {str(config_path)!r} does not hold a JSON object")
    return model_fingerprint(config, dtype=dtype, revision=revision)


def normalize_dtype(dtype: str) -> str:
    """Canonical spelling of a dtype name: no ``torch.`` prefix, lower case, common aliases."""
    name = dtype.strip().lower().removeprefix("torch.")
    if not name:
        raise ValueError(f"dtype: must name a dtype, got {dtype!r}")
    return _DTYPE_ALIASES.get(name, name)


def _first_block_prefix(model_fingerprint: bytes, cache_salt: str | bytes) -> bytes:
    if not isinstance(model_fingerprint, bytes):
        raise ValueError(f"model_fingerprint: expected bytes, got {type(model_fingerprint)}")
    salt = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else cache_salt
    if not isinstance(salt, bytes):
        raise ValueError(f"cache_salt: expected str or bytes, got {type(cache_salt)}")
    return DOMAIN + _u32le(len(model_fingerprint)) + model_fingerprint + _u32le(len(salt)) + salt


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or not 0 <= t < _MAX_TOKEN_ID:
                raise ValueError(
                    f"tokens[{i}]: token id must be in [0, 2**32), got {t!r}"
                ) from None
        raise


def _u32le(n: int) -> bytes:
    return struct.pack("<I", n)


def _drop_volatile(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_volatile(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, list | tuple):
        return [_drop_volatile(v) for v in value]
    return value
