"""DiskTier bookkeeping and files (torch-free): blocks read back exactly, at once and after a
reopen; oldest files evicted first within the size; files of another compat key deleted;
corrupt files dropped and counted; one tier per directory."""

from __future__ import annotations

import pytest

from pagedserve.kvstore.disk_tier import (
    FILE_HEADER_BYTES,
    RECORD_HEADER_BYTES,
    DiskTier,
    blocks_per_file_for,
    check_disk_config,
    disk_blocks_for,
    segment_name,
)
from pagedserve.kvstore.hashing import BlockHash

PER_BLOCK = 64
KEY = bytes(range(16))
RECORD = RECORD_HEADER_BYTES + PER_BLOCK


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def block(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PER_BLOCK))


def tier(directory, capacity: int = 64 * RECORD, key: bytes = KEY) -> DiskTier:
    return DiskTier(directory, capacity, bytes_per_block=PER_BLOCK, compat_key=key)


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("seg-*.kvd"))


def test_blocks_read_back_exactly_before_and_after_they_reach_the_disk(tmp_path):
    disk = tier(tmp_path)
    for i in range(10):
        assert disk.put(h(i), block(i))
    assert not disk.put(h(3), block(3)), "a hash already held is not written twice"
    assert disk.read(h(4)) == block(4)  # possibly still queued
    disk.flush()
    assert [disk.read(h(i)) for i in range(10)] == [block(i) for i in range(10)]
    assert disk.read(h(99)) is None
    disk.check_integrity()
    disk.close()


def test_a_reopened_tier_finds_its_blocks_and_a_promoted_one_is_forgotten(tmp_path):
    disk = tier(tmp_path)
    for i in range(10):
        disk.put(h(i), block(i))
    disk.take(h(2))
    disk.discard(h(3))
    assert h(2) not in disk and h(3) not in disk and disk.stats.promotions == 1
    disk.close()
    again = tier(tmp_path)
    # NOTE: a forgotten block's record stays in its file: valid KV of its hash, found again
    assert again.num_blocks == 10 and again.read(h(7)) == block(7)
    again.check_integrity()
    again.close()


def test_files_of_another_compat_key_are_deleted_at_start(tmp_path):
    disk = tier(tmp_path)
    for i in range(10):
        disk.put(h(i), block(i))
    disk.close()
    assert files(tmp_path)
    other = tier(tmp_path, key=bytes(16))
    assert other.num_blocks == 0 and other.stats.stale_files > 0 and not files(tmp_path)
    other.close()


def test_the_oldest_file_goes_first_and_the_size_is_never_exceeded(tmp_path):
    capacity = 3 * (FILE_HEADER_BYTES + RECORD) + RECORD - 1
    disk = tier(tmp_path, capacity)
    assert disk.blocks_per_file == blocks_per_file_for(capacity, PER_BLOCK) == 1
    assert disk_blocks_for(capacity, PER_BLOCK) == 3
    for i in range(8):
        disk.put(h(i), block(i))
        disk.flush()
        disk.check_integrity()
        assert sum(p.stat().st_size for p in tmp_path.glob("seg-*.kvd")) <= capacity
    assert sorted(disk.hashes()) == [h(5), h(6), h(7)]
    assert disk.stats.evictions == 5
    disk.close()


def test_blocks_share_files_and_leave_with_them(tmp_path):
    capacity = 4 * (FILE_HEADER_BYTES + 4 * RECORD)
    disk = tier(tmp_path, capacity)
    assert disk.blocks_per_file == 2
    for i in range(40):
        disk.put(h(i), block(i))
        disk.check_integrity()
    disk.flush()
    assert sum(p.stat().st_size for p in tmp_path.glob("seg-*.kvd")) <= capacity
    held = sorted(int.from_bytes(x, "little") for x in disk.hashes())
    assert held == list(range(40 - len(held), 40)) and len(held) % 2 == 0
    assert len(files(tmp_path)) == len(held) // 2
    disk.close()


def test_a_flipped_byte_drops_its_file_counted(tmp_path):
    disk = tier(tmp_path, 64 * RECORD)
    for i in range(4):
        disk.put(h(i), block(i))
    disk.flush()
    number, offset = disk._where[h(1)]
    path = tmp_path / segment_name(number)
    raw = bytearray(path.read_bytes())
    raw[offset + RECORD_HEADER_BYTES] ^= 1
    path.write_bytes(raw)
    assert disk.read(h(1)) is None
    disk.flush()
    assert disk.stats.corrupt_files == 1 and not path.exists()
    assert all(h(i) not in disk for i in range(4)), "the whole file is dropped"
    disk.check_integrity()
    disk.close()


def test_a_truncated_or_garbled_file_is_ignored_at_start(tmp_path):
    disk = tier(tmp_path, 64 * RECORD)
    for i in range(4):
        disk.put(h(i), block(i))
    disk.close()
    (name,) = files(tmp_path)
    (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:-1])
    (tmp_path / segment_name(7)).write_bytes(b"not a segment")
    again = tier(tmp_path)
    assert again.num_blocks == 0 and again.stats.corrupt_files == 2 and not files(tmp_path)
    again.close()


def test_clear_deletes_every_file(tmp_path):
    disk = tier(tmp_path)
    for i in range(5):
        disk.put(h(i), block(i))
    assert disk.clear() == 5
    disk.flush()
    assert disk.num_blocks == 0 and disk.bytes_used == 0 and not files(tmp_path)
    disk.close()


def test_one_tier_per_directory_and_bad_directories_refused(tmp_path):
    disk = tier(tmp_path)
    with pytest.raises(ValueError, match="kv-offload-dir: .* in use"):
        tier(tmp_path)
    disk.close()
    tier(tmp_path).close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv-offload-dir: .* not a directory"):
        tier(tmp_path / "file")
    with pytest.raises(ValueError, match="kv-offload-disk: .* too small"):
        tier(tmp_path / "tiny", FILE_HEADER_BYTES + RECORD - 1)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ((8, 1, "d", 0), "kv-offload-dir: needs --kv-offload-disk"),
        ((8, 1, None, 1024), "kv-offload-disk: needs --kv-offload-dir"),
        ((0, 1, "d", 1024), "kv-offload-dir: .* needs --kv-offload-memory"),
        ((8, 2, "d", 1024), "kv-offload-dir: .* --tensor-parallel-size"),
        ((8, 1, "d", -1), "kv-offload-disk: must be >= 0"),
    ],
)
def test_half_given_or_unsupported_disk_flags_are_refused(args, flag):
    with pytest.raises(ValueError, match=flag):
        check_disk_config(*args)
