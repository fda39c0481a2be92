"""DiskTier: the prefix cache's disk tier (``--kv-offload-dir DIR --kv-offload-disk BYTES``).

Below the host tier (``host_tier.py``): a block the host tier evicts is written here instead of
being lost, and a prefix match that runs past the device's and the host's blocks continues into
the hashes held here (``kv_offload.KVOffload.promote`` reads them back, one read per block).
Torch-free: blocks come and go as bytes; ``kv_offload.py`` owns the tensors.

Layout (docs/kv_tiers.md): a log of segment files ``seg-<number>.kvd`` in one directory per
worker, each a file header and up to ``blocks_per_file`` fixed-size records::

    file header  magic "PSKVDSK1" | u32 version | 16-byte compat key | u64 bytes per block
                 | u32 CRC32 of the above
    record       16-byte block hash | u32 CRC32 of the payload | u32 CRC32 of hash + that CRC
                 | payload (one block of the KV pool's layout)

Blocks are appended to the newest file; a full tier deletes its oldest file (FIFO, as the host
tier gives up the block stored longest ago first). A corrupt or truncated file is ignored:
counted (``corrupt_files``), logged and deleted; a file of another compat key (model, dtype,
block layout) is deleted at start. The directory is locked (``flock``) by one tier at a time.

Writes are asynchronous: ``put`` only reserves the record's place and queues the bytes for the
writer thread; the block is visible (``in``, ``read``) at once, served from the queued bytes
until they are on disk. The queue is bounded (``max_pending`` blocks); a ``put`` on a full
queue is dropped (``dropped``). Reads are synchronous.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import re
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.kvstore.hashing import BLOCK_HASH_BYTES, BlockHash

log = logging.getLogger(__name__)

MAGIC = b"PSKVDSK1"
VERSION = 1
COMPAT_KEY_BYTES = 16
_FILE_HEAD = struct.Struct(f"<8sI{COMPAT_KEY_BYTES}sQ")
FILE_HEADER_BYTES = _FILE_HEAD.size + 4
_RECORD_HEAD = struct.Struct(f"<{BLOCK_HASH_BYTES}sI")
RECORD_HEADER_BYTES = _RECORD_HEAD.size + 4
MAX_BLOCKS_PER_FILE = 32
MIN_FILES = 8  # NOTE: files are evicted whole: at least this many keep each eviction small
LOCK_NAME = ".lock"
_SEGMENT = re.compile(r"^seg-(\d{8,})\.kvd$")


class CorruptFile(Exception):
    """A segment file whose header or a record does not check out."""


class StaleFile(CorruptFile):
    """A segment file of another configuration (its compat key differs)."""


@dataclass(slots=True)
class DiskStats:
    """Monotonic counters of the disk tier, in blocks (bytes: blocks x bytes per block)."""

    writes: int = 0  # blocks queued for writing (an evicted host block spilled)
    hits: int = 0  # prefix-match lookups answered by the disk tier
    promotions: int = 0  # blocks read back and registered on the device
    evictions: int = 0  # blocks dropped with the oldest file to make room
    dropped: int = 0  # blocks not written: the writer's queue was full
    corrupt_files: int = 0  # files ignored and deleted: bad header, checksum or truncated
    stale_files: int = 0  # files of another configuration (compat key) deleted at start


@dataclass(frozen=True, slots=True)
class DiskPlan:
    """The disk tier an engine asks for: ``directory`` (None: none), its size in bytes and
    the compat key its files carry (``transfer.layout_compat_hash``: model, dtype, layout)."""

    directory: str | None
    capacity_bytes: int
    compat_key: bytes = bytes(COMPAT_KEY_BYTES)


@dataclass(slots=True)
class _Segment:
    number: int
    size: int = FILE_HEADER_BYTES  # bytes reserved (written or queued)
    records: int = 0
    live: set[BlockHash] = field(default_factory=set)


def segment_name(number: int) -> str:
    return f"seg-{number:08d}.kvd"


def file_header(compat_key: bytes, bytes_per_block: int) -> bytes:
    head = _FILE_HEAD.pack(MAGIC, VERSION, compat_key, bytes_per_block)
    return head + struct.pack("<I", zlib.crc32(head))


def record_header(block_hash: BlockHash, payload: bytes | bytearray | memoryview) -> bytes:
    head = _RECORD_HEAD.pack(block_hash, zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head))


def disk_blocks_for(capacity_bytes: int, bytes_per_block: int) -> int:
    """How many blocks ``capacity_bytes`` holds (file headers and record headers included)."""
    record = RECORD_HEADER_BYTES + bytes_per_block
    per_file = blocks_per_file_for(capacity_bytes, bytes_per_block)
    file_bytes = FILE_HEADER_BYTES + per_file * record
    whole, rest = divmod(capacity_bytes, file_bytes)
    return whole * per_file + max(0, (rest - FILE_HEADER_BYTES) // record)


def blocks_per_file_for(capacity_bytes: int, bytes_per_block: int) -> int:
    """Blocks per segment file: at most ``MAX_BLOCKS_PER_FILE``, and few enough that the tier
    holds ``MIN_FILES`` files where it can."""
    record = RECORD_HEADER_BYTES + bytes_per_block
    return max(1, min(MAX_BLOCKS_PER_FILE, capacity_bytes // (MIN_FILES * record)))


def check_disk_config(
    host_tier_size: int, tensor_parallel_size: int, disk_dir: str | None, disk_bytes: int
) -> None:
    """ValueError naming the flag for a disk tier given half (``--kv-offload-dir`` without
    ``--kv-offload-disk`` or the reverse), without the host tier above it (``host_tier_size``
    0), with more than one tensor-parallel rank, or at a path that is not a directory."""
    if disk_bytes < 0:
        raise ValueError(f"kv-offload-disk: must be >= 0 bytes, got {disk_bytes}")
    if disk_bytes > 0 and not disk_dir:
        raise ValueError("kv-offload-disk: needs --kv-offload-dir DIR (where the tier's files go)")
    if not disk_dir:
        return
    if disk_bytes == 0:
        raise ValueError("kv-offload-dir: needs --kv-offload-disk BYTES (the disk tier's size)")
    if tensor_parallel_size > 1:
        raise ValueError(
            "kv-offload-dir: the disk KV tier is not supported with --tensor-parallel-size above 1"
        )
    if host_tier_size <= 0:
        raise ValueError(
            "kv-offload-dir: the disk tier keeps the blocks the host tier evicts; it needs "
            "--kv-offload-memory above 0"
        )
    if os.path.exists(disk_dir) and not os.path.isdir(disk_dir):
        raise ValueError(f"kv-offload-dir: {disk_dir!r} exists and is not a directory")


def open_disk_dir(directory: str | Path) -> tuple[Path, int]:
    """The tier's directory, created if missing, and an open descriptor holding its lock;
    ValueError naming ``kv-offload-dir`` if it is not a writable directory or another tier (a
    worker of this host) holds it."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"kv-offload-dir: {str(path)!r} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"kv-offload-dir: cannot use {str(path)!r}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(
            f"kv-offload-dir: {str(path)!r} is in use by another worker (each worker needs "
            "its own directory)"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        os.close(fd)
        raise ValueError(f"kv-offload-dir: {str(path)!r} is not writable")
    return path, fd


class DiskTier:
    """A bounded log of segment files holding blocks keyed by ``BlockHash``.

    Contracts:
    - The files in the directory never exceed ``capacity_bytes`` (place is reserved before a
      write; the oldest files are deleted first, before any later write reaches the disk).
    - ``read`` returns a block's exact bytes as ``put`` gave them, or None: a missing block, or
      one whose file is corrupt (that file is then dropped, counted and deleted).
    - Only the thread that calls ``put`` / ``read`` / ``take`` / ``discard`` changes the index;
      the writer thread only writes and deletes files, in the order they were queued.
    - ``close`` writes every queued block, stops the writer and releases the directory.
    """

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        *,
        bytes_per_block: int,
        compat_key: bytes,
        max_pending: int = 64,
    ) -> None:
        if len(compat_key) != COMPAT_KEY_BYTES:
            raise ValueError(f"compat_key: expected {COMPAT_KEY_BYTES} bytes")
        self.record_bytes = RECORD_HEADER_BYTES + bytes_per_block
        if capacity_bytes < FILE_HEADER_BYTES + self.record_bytes:
            raise ValueError(
                f"kv-offload-disk: {capacity_bytes} bytes is too small for one block "
                f"({FILE_HEADER_BYTES + self.record_bytes} bytes needed)"
            )
        self.capacity_bytes = capacity_bytes
        self.bytes_per_block = bytes_per_block
        self.compat_key = compat_key
        self.blocks_per_file = blocks_per_file_for(capacity_bytes, bytes_per_block)
        self.max_pending = max_pending
        self.stats = DiskStats()
        # NOTE: told of the hashes a dropped file held (evicted, corrupt or cleared), so that
        # the prefix index forgets them (kv_offload.KVOffload publishes them as REMOVED).
        self.on_dropped: Callable[[list[BlockHash]], object] | None = None
        self._files: OrderedDict[int, _Segment] = OrderedDict()  # oldest first
        self._where: dict[BlockHash, tuple[int, int]] = {}  # hash -> (file, record offset)
        self._pending: dict[BlockHash, tuple[int, int, bytes]] = {}  # queued, not yet written
        self._used = 0
        self._current: _Segment | None = None
        self._next_number = 0
        self._lock = threading.Lock()
        self.directory, self._lock_fd = open_disk_dir(directory)
        self._scan()
        self._queue: queue.Queue[tuple[str, int, int, BlockHash, bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- state ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._where)

    @property
    def bytes_used(self) -> int:
        """Bytes the tier's files take (written or queued)."""
        return self._used

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._where

    def hashes(self) -> list[BlockHash]:
        return list(self._where)

    # -- writes -----------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, data: bytes) -> bool:
        """Hold ``data`` (one block) under ``block_hash``: visible at once, written by the
        writer thread. False when the hash is already held or the queue is full (dropped)."""
        if len(data) != self.bytes_per_block:
            raise ValueError(f"data: {len(data)} bytes, expected {self.bytes_per_block}")
        if block_hash in self._where:
            return False
        if len(self._pending) >= self.max_pending:
            self.stats.dropped += 1
            return False
        number, offset = self._reserve()
        with self._lock:
            self._pending[block_hash] = (number, offset, data)
        self._where[block_hash] = (number, offset)
        self._files[number].live.add(block_hash)
        self._queue.put(("write", number, offset, block_hash, data))
        self.stats.writes += 1
        return True

    def _reserve(self) -> tuple[int, int]:
        """A record's place (file, offset), evicting the oldest files until it fits."""
        current = self._current
        if current is not None and current.records >= self.blocks_per_file:
            current = None
        needed = self.record_bytes + (0 if current is not None else FILE_HEADER_BYTES)
        while self._used + needed > self.capacity_bytes:
            oldest = next(iter(self._files))
            if current is not None and oldest == current.number:
                current = None
                needed += FILE_HEADER_BYTES
            self._drop_file(oldest, evicted=True)
        if current is None:
            current = _Segment(self._next_number)
            self._next_number += 1
            self._files[current.number] = current
            self._used += FILE_HEADER_BYTES
        self._current = current
        offset = current.size
        current.size += self.record_bytes
        current.records += 1
        self._used += self.record_bytes
        return current.number, offset

    def _drop_file(self, number: int, *, evicted: bool = False) -> None:
        """Forget file ``number``'s blocks and queue its deletion."""
        segment = self._files.pop(number)
        if self.on_dropped is not None and segment.live:
            self.on_dropped(list(segment.live))
        for block_hash in segment.live:
            del self._where[block_hash]
            with self._lock:
                self._pending.pop(block_hash, None)
        if evicted:
            self.stats.evictions += len(segment.live)
        self._used -= segment.size
        if self._current is segment:
            self._current = None
        self._queue.put(("delete", number, 0, BlockHash(b""), b""))

    # -- reads and removal ------------------------------------------------------------------

    def read(self, block_hash: BlockHash) -> bytearray | None:
        """The verified bytes of ``block_hash``, or None (not held, or its file is corrupt:
        then the file is dropped, counted, logged and deleted)."""
        where = self._where.get(block_hash)
        if where is None:
            return None
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            return bytearray(pending[2])
        number, offset = where
        try:
            return self._read_record(number, offset, block_hash)
        except (CorruptFile, OSError) as exc:
            self._corrupt(number, str(exc))
            return None

    def _read_record(self, number: int, offset: int, block_hash: BlockHash) -> bytearray:
        path = self.directory / segment_name(number)
        with open(path, "rb") as f:
            f.seek(offset)
            head = f.read(RECORD_HEADER_BYTES)
            data = bytearray(self.bytes_per_block)
            got = f.readinto(data)
        stored_hash, crc = _check_record_header(head)
        if got != self.bytes_per_block:
            raise CorruptFile(f"{path.name}: truncated at offset {offset}")
        if stored_hash != block_hash:
            raise CorruptFile(f"{path.name}: offset {offset} holds another block")
        if zlib.crc32(data) != crc:
            raise CorruptFile(f"{path.name}: checksum mismatch at offset {offset}")
        return data

    def _corrupt(self, number: int, reason: str) -> None:
        log.warning("kv disk tier: ignoring corrupt file %s (%s)", segment_name(number), reason)
        self.stats.corrupt_files += 1
        self._drop_file(number)

    def take(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` (read, and now registered on the device): a promotion. It
        may be gone already (its file evicted after the read): counted all the same."""
        self._forget(block_hash)
        self.stats.promotions += 1

    def discard(self, block_hash: BlockHash) -> bool:
        """Forget ``block_hash`` if held (the device holds it again); whether it was held. Its
        record stays in its file, dead, until the file is evicted."""
        return self._forget(block_hash)

    def _forget(self, block_hash: BlockHash) -> bool:
        where = self._where.pop(block_hash, None)
        if where is None:
            return False
        self._files[where[0]].live.discard(block_hash)
        with self._lock:
            self._pending.pop(block_hash, None)
        return True

    def clear(self) -> int:
        """Delete every file (the prefix cache was reset); how many blocks were held."""
        held = len(self._where)
        for number in list(self._files):
            self._drop_file(number)
        return held

    # -- writer thread ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (op := self._queue.get()) is not None:
            kind, number, offset, block_hash, data = op
            path = self.directory / segment_name(number)
            try:
                if kind == "delete":
                    path.unlink(missing_ok=True)
                else:
                    self._write_record(path, offset, block_hash, data)
            except Exception as exc:  # NOTE: a failed write is found at read (truncated)
                log.warning("kv disk tier: %s %s failed: %s", kind, path.name, exc)
            finally:
                if kind == "write":
                    with self._lock:
                        if self._pending.get(block_hash, (None, None))[:2] == (number, offset):
                            del self._pending[block_hash]
                self._queue.task_done()
        self._queue.task_done()

    def _write_record(self, path: Path, offset: int, block_hash: BlockHash, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if offset == FILE_HEADER_BYTES:
                os.pwrite(fd, file_header(self.compat_key, self.bytes_per_block), 0)
            os.pwrite(fd, record_header(block_hash, data) + data, offset)
        finally:
            os.close(fd)

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer and release the directory's lock."""
        if self._lock_fd < 0:
            return
        self._queue.put(None)
        self._writer.join()
        os.close(self._lock_fd)
        self._lock_fd = -1

    # -- start-up scan ----------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the files of a previous run: oldest first; corrupt files
        and files of another compat key are deleted; then evict down to the capacity."""
        numbers = sorted(
            int(m.group(1)) for p in self.directory.iterdir() if (m := _SEGMENT.match(p.name))
        )
        for number in numbers:
            path = self.directory / segment_name(number)
            try:
                records = self._scan_file(path)
            except StaleFile:
                self.stats.stale_files += 1
                path.unlink(missing_ok=True)
                continue
            except (CorruptFile, OSError) as exc:
                self.stats.corrupt_files += 1
                log.warning("kv disk tier: ignoring corrupt file %s (%s)", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            self._adopt(number, records)
        if self.stats.stale_files:
            log.info("kv disk tier: deleted %d stale files", self.stats.stale_files)
        self._next_number = numbers[-1] + 1 if numbers else 0
        while self._used > self.capacity_bytes:
            self._evict_at_start(next(iter(self._files)))

    def _scan_file(self, path: Path) -> list[tuple[BlockHash, int]]:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(FILE_HEADER_BYTES)
            if len(head) != FILE_HEADER_BYTES or head[:8] != MAGIC:
                raise CorruptFile("bad file header")
            if struct.unpack("<I", head[-4:])[0] != zlib.crc32(head[:-4]):
                raise CorruptFile("file header checksum mismatch")
            _, version, key, per_block = _FILE_HEAD.unpack(head[:-4])
            if (version, key, per_block) != (VERSION, self.compat_key, self.bytes_per_block):
                raise StaleFile("compat key differs")
            count, rest = divmod(size - FILE_HEADER_BYTES, self.record_bytes)
            if rest or count == 0:
                raise CorruptFile(f"truncated ({size} bytes)")
            records = []
            for i in range(count):
                offset = FILE_HEADER_BYTES + i * self.record_bytes
                f.seek(offset)
                block_hash, _ = _check_record_header(f.read(RECORD_HEADER_BYTES))
                records.append((block_hash, offset))
        return records

    def _adopt(self, number: int, records: list[tuple[BlockHash, int]]) -> None:
        segment = _Segment(number, FILE_HEADER_BYTES + len(records) * self.record_bytes)
        segment.records = len(records)
        self._files[number] = segment
        self._used += segment.size
        for block_hash, offset in records:
            old = self._where.get(block_hash)
            if old is not None:  # NOTE: written twice (promoted, spilled again): keep the newer
                self._files[old[0]].live.discard(block_hash)
            self._where[block_hash] = (number, offset)
            segment.live.add(block_hash)

    def _evict_at_start(self, number: int) -> None:
        segment = self._files.pop(number)
        if self.on_dropped is not None and segment.live:
            self.on_dropped(list(segment.live))
        for block_hash in segment.live:
            del self._where[block_hash]
        self._used -= segment.size
        (self.directory / segment_name(number)).unlink(missing_ok=True)

    # -- integrity --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first broken invariant: the index and the files' live
        sets agree, queued blocks are indexed, and the reserved bytes are within capacity."""
        live = sum(len(s.live) for s in self._files.values())
        if live != len(self._where):
            raise RuntimeError(f"integrity: disk tier live {live} != indexed {len(self._where)}")
        for block_hash, (number, _) in self._where.items():
            segment = self._files.get(number)
            if segment is None or block_hash not in segment.live:
                raise RuntimeError(f"integrity: disk block {block_hash.hex()} not in its file")
        used = sum(s.size for s in self._files.values())
        if used != self._used or used > self.capacity_bytes:
            raise RuntimeError(
                f"integrity: disk tier uses {used} bytes (counted {self._used}, "
                f"capacity {self.capacity_bytes})"
            )
        with self._lock:
            stray = [h for h in self._pending if h not in self._where]
        if stray:
            raise RuntimeError(f"integrity: {len(stray)} queued disk blocks are not indexed")


def _check_record_header(head: bytes) -> tuple[BlockHash, int]:
    if len(head) != RECORD_HEADER_BYTES:
        raise CorruptFile("truncated record header")
    if struct.unpack("<I", head[-4:])[0] != zlib.crc32(head[:-4]):
        raise CorruptFile("record header checksum mismatch")
    block_hash, crc = _RECORD_HEAD.unpack(head[:-4])
    return BlockHash(block_hash), crc
