"""KV transfer transports: how a decode worker gets a prefill worker's blocks.

- **shm**: the producer's whole KV pool lives in a POSIX shared-memory segment; a consumer on the
  same host maps it and copies the blocks it needs (`ShmKVPool` / `ShmBlockReader`).
- **grpc**: the producer streams the blocks' bytes in bounded chunks (`iter_block_chunks`) and
  the consumer writes them into its own blocks as they arrive (`BlockAssembler`).

Both move whole blocks in the wire layout of docs/kv_layout.md (one block = for each layer, the
K page then the V page), which is exactly one block of our block-major page tensor.

NOTE: nothing here checks leases. Bytes read are only trustworthy if the lease was still held
after the copy finished; the consumer confirms that with the producer (ReleaseKv) and otherwise
recomputes (docs/leases.md, fail closed).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from pagedserve.kvstore.kv_cache import KV_DIM, SCALE_LAYOUT, KVCache, KVCacheSpec


class TransferError(RuntimeError):
    """A transfer that cannot be trusted: the consumer must recompute the prompt."""


def layout_compat_hash(
    spec: KVCacheSpec, model_fingerprint: bytes, tensor_parallel_size: int = 1
) -> bytes:
    """16 bytes identifying weights + layout; blocks move only between equal hashes. An 8-bit
    cache's scale layout and a tensor-parallel worker's rank count are part of it (`spec` is
    then one rank's shard); unquantized single-rank layouts hash as they always did."""
    fields = struct.pack(
        "<IIII", spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size
    )
    body = b"pagedserve/kv-layout/v1" + model_fingerprint + fields + spec.dtype_name.encode()
    if spec.quantized:
        body += b"|scales=" + SCALE_LAYOUT.encode()
    if tensor_parallel_size > 1:
        body += b"|tp=%d" % tensor_parallel_size
    return hashlib.sha256(body).digest()[:16]


def host_id() -> str:
    """Identity of the shared-memory namespace this process sees.

    Two processes may use shm only if this is equal: same kernel boot and the same /dev/shm
    (a pod on the same node without a shared /dev/shm gets a different value).
    """
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    try:
        st = os.stat("/dev/shm")
        parts.append(f"{st.st_dev}:{st.st_ino}")
    except OSError:
        parts.append("")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class ShmOffer:
    """Where a pool's pages are in a segment (the `ShmTransport` message, without protobuf)."""

    segment_name: str
    host_id: str
    pool_offset_bytes: int
    num_blocks: int
    block_stride_bytes: int
    layer_stride_bytes: int
    kv_stride_bytes: int


def _strides_bytes(spec: KVCacheSpec) -> tuple[int, int, int]:
    """(block, layer, kv) strides of the block-major layout, in bytes (an 8-bit block's scales
    follow its codes, inside the block stride)."""
    page = spec.codes_bytes // (spec.num_layers * KV_DIM)
    return spec.bytes_per_block, KV_DIM * page, page


class ShmKVPool:
    """A `KVCache` whose page tensor lives in a new shared-memory segment owned by this object.

    `close()` unlinks the segment; callers must drop every view of `cache.tensor` first.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, name: str | None = None) -> None:
        size = spec.bytes_per_block * num_blocks
        self._shm = shared_memory.SharedMemory(
            name=name or f"pagedserve-kv-{secrets.token_hex(8)}", create=True, size=size
        )
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size)
        tensor = flat.view(spec.storage_dtype).view(spec.storage_shape(num_blocks))
        tensor.zero_()
        self.cache = KVCache(spec, num_blocks, tensor=tensor)

    @property
    def segment_name(self) -> str:
        return self._shm.name

    def offer(self) -> ShmOffer:
        block, layer, kv = _strides_bytes(self.cache.spec)
        return ShmOffer(
            segment_name=self._shm.name,
            host_id=host_id(),
            pool_offset_bytes=0,
            num_blocks=self.cache.num_blocks,
            block_stride_bytes=block,
            layer_stride_bytes=layer,
            kv_stride_bytes=kv,
        )

    def close(self) -> None:
        del self.cache
        self._shm.close()
        self._shm.unlink()


class ShmBlockReader:
    """A consumer's read-only mapping of a producer's segment."""

    def __init__(self, offer: ShmOffer, spec: KVCacheSpec) -> None:
        if offer.host_id != host_id():
            raise TransferError("shm: producer is on another host")
        if _strides_bytes(spec) != (
            offer.block_stride_bytes,
            offer.layer_stride_bytes,
            offer.kv_stride_bytes,
        ):
            raise TransferError("shm: producer's page layout differs from ours")
        try:
            self._shm = shared_memory.SharedMemory(name=offer.segment_name)
        except FileNotFoundError as exc:
            raise TransferError(f"shm: segment {offer.segment_name} is gone") from exc
        # NOTE: Python < 3.13 registers attached segments with the resource tracker, which would
        # unlink the producer's segment when this process exits. We only borrow it.
        resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        size = offer.block_stride_bytes * offer.num_blocks
        if offer.pool_offset_bytes + size > self._shm.size:
            self._shm.close()
            raise TransferError("shm: segment is smaller than the offer says")
        flat = torch.frombuffer(
            self._shm.buf, dtype=torch.uint8, count=size, offset=offer.pool_offset_bytes
        )
        self._tensor: torch.Tensor | None = flat.view(spec.storage_dtype).view(
            spec.storage_shape(offer.num_blocks)
        )
        self.num_blocks = offer.num_blocks

    def read_blocks(self, src_ids: Sequence[int], dst: KVCache, dst_ids: Sequence[int]) -> None:
        """Copy producer blocks `src_ids` into `dst` blocks `dst_ids` (same order)."""
        if self._tensor is None:
            raise RuntimeError("shm: reader is closed")
        if len(src_ids) != len(dst_ids):
            raise ValueError("dst_ids: must pair one-to-one with src_ids")
        if any(not 0 <= b < self.num_blocks for b in src_ids):
            raise TransferError(f"shm: block id out of range 0..{self.num_blocks - 1}")
        src = torch.tensor(list(src_ids), dtype=torch.int64)
        dst.tensor[torch.tensor(list(dst_ids), dtype=torch.int64)] = self._tensor[src].to(
            dst.tensor.device
        )

    def close(self) -> None:
        self._tensor = None
        self._shm.close()


@dataclass(frozen=True, slots=True)
class BlockChunk:
    """Part of one block's bytes (the `KvChunk` message, without protobuf)."""

    block_index: int  # index into the handle's block list
    block_id: int  # producer's block id
    offset: int  # byte offset within the block
    data: bytes
    last_of_block: bool


def block_bytes(cache: KVCache, block_id: int) -> bytes:
    """One block's pages in wire layout (a copy; from a device pool through host memory)."""
    return cache.block(block_id).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def iter_block_chunks(
    cache: KVCache, block_ids: Sequence[int], max_chunk_bytes: int, indices: Sequence[int] = ()
) -> Iterator[BlockChunk]:
    """Chunks of the listed blocks in order; `indices` picks entries of `block_ids` (all if empty).

    Each block's bytes are copied when its turn comes, so the stream holds one block at a time.
    """
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes: must be positive, got {max_chunk_bytes}")
    for index in indices or range(len(block_ids)):
        if not 0 <= index < len(block_ids):
            raise ValueError(f"block_indices: {index} is not in 0..{len(block_ids) - 1}")
        data = block_bytes(cache, block_ids[index])
        for offset in range(0, len(data), max_chunk_bytes):
            part = data[offset : offset + max_chunk_bytes]
            last = offset + len(part) == len(data)
            yield BlockChunk(index, block_ids[index], offset, part, last)


class BlockAssembler:
    """Writes streamed chunks into the consumer's blocks, checking order and sizes.

    `dst_ids` maps a handle's block index to the consumer's block id for every block expected.
    Any gap, overlap, size or order error raises TransferError; nothing half-written is reported
    complete.
    """

    def __init__(self, cache: KVCache, dst_ids: dict[int, int]) -> None:
        self.cache = cache
        self.dst_ids = dict(dst_ids)
        self.block_nbytes = cache.spec.bytes_per_block
        self._buffer = bytearray()
        self._current: int | None = None
        self.done: set[int] = set()

    def feed(self, chunk: BlockChunk) -> None:
        if chunk.block_index not in self.dst_ids or chunk.block_index in self.done:
            raise TransferError(f"kv: unexpected chunk for block index {chunk.block_index}")
        if self._current is None:
            self._current = chunk.block_index
        if chunk.block_index != self._current or chunk.offset != len(self._buffer):
            raise TransferError(f"kv: chunk out of order at block index {chunk.block_index}")
        self._buffer += chunk.data
        if len(self._buffer) > self.block_nbytes:
            raise TransferError("kv: block longer than the layout allows")
        if chunk.last_of_block:
            if len(self._buffer) != self.block_nbytes:
                raise TransferError("kv: block shorter than the layout requires")
            page = torch.frombuffer(self._buffer, dtype=torch.uint8)
            target = self.cache.block(self.dst_ids[chunk.block_index])
            target.copy_(page.view(target.dtype).view(target.shape))
            del page  # releases the buffer export so it can be cleared
            self.done.add(chunk.block_index)
            self._buffer.clear()
            self._current = None

    @property
    def complete(self) -> bool:
        return self._current is None and self.done == set(self.dst_ids)
