"""KVOffload: the host-memory tier's tensor and copies (``--kv-offload-memory``).

The device pool's ``BlockPool`` calls it (``TierListener``) as it evicts a cached block; it
copies the block's KV into a host slot that ``HostTier`` registers under the block's hash::

    device KVCache.tensor [num_blocks, ...] ──evicted(block)──► host tensor [num_slots, ...]
                          ▲                                              │
                          └────────── promote (KVCacheManager.match_prefix) ┘

On CUDA the copies use the swap path's kernel (``kernels.dispatch.swap_blocks``), issued on the
current stream, and the stream is synchronised after each batch. On CPU both pools are RAM and a
copy is a single-threaded memcpy of the block's bytes (``_byte_view``), complete on return.

NOTE: synchronous by design for now: an eviction happens inside ``BlockPool.allocate``, and
the block it frees may be written at once by whoever allocated it (a forward, a swap-in or a
KV import on another thread), so the copy out must be complete before ``allocate`` returns.
On CPU that is the decision (a block is a 0.1-0.2 ms memcpy on the same cores the forward uses);
on CUDA, overlapping it (an event per batch, waited for by writers off the current stream) is
designed in docs/kv_tiers.md, "Why the copy out stays synchronous", and not built.

With a disk tier (``disk_tier.DiskTier``, ``--kv-offload-dir``), a host slot the host tier
reuses is first handed to it (its bytes copied out, written by the disk tier's writer thread),
and ``promote`` continues the host run with the disk run (one checked read per block).

The prefix index sees the tiers (docs/prefix_index.md, "Tiers"): every move (device → host,
host → disk, out of the last tier) is recorded as a ``BlockEvent`` with its tier into the device
pool's event log (``attach``), in order with the pool's own events; a promotion is recorded by
the pool alone (STORED on the device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pagedserve.kernels.dispatch import swap_blocks
from pagedserve.kvstore.block_pool import BlockEventKind, BlockId, BlockPool, EventSink, Tier
from pagedserve.kvstore.disk_tier import DiskPlan, DiskTier, check_disk_config
from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.host_tier import HostTier, OffloadCounts, SlotId, check_tiers_disjoint
from pagedserve.kvstore.kv_cache import KVCacheSpec
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.kvstore.transfer import layout_compat_hash


def _byte_view(block: torch.Tensor) -> memoryview:
    """The bytes of one contiguous CPU block, writable in place.

    NOTE: the tier's CPU copies go through these (a single-threaded memcpy), not through
    ``Tensor.copy_``: torch splits a 720 KiB copy across its intra-op threads, and on cores
    that other processes keep busy each such copy waited for a descheduled thread (6-12 ms
    per block instead of 0.1-0.2 ms, measured in docs/kv_tiers.md)."""
    return block.view(-1).view(torch.uint8).numpy().data


def offload_slots_for(spec: KVCacheSpec, offload_bytes: int) -> int:
    """How many blocks of ``spec`` fit in ``offload_bytes`` of host memory (at least 0)."""
    if offload_bytes < 0:
        raise ValueError(f"kv-offload-memory: must be >= 0, got {offload_bytes}")
    return spec.num_blocks_for(offload_bytes)


class KVOffload:
    """The host tier of one device pool: ``num_slots`` host blocks mirroring its layout.

    Contracts:
    - Attach with ``pool.set_tier(offload)``; the pool then reports evictions and new hashes.
    - ``device_tensor`` is the pool's KV tensor and is never reallocated while attached.
    - A hash is in at most one of the two tiers (``check_integrity`` checks it).
    - A promotion overwrites the device blocks it allocates at once: a caller with other
      pending readers of device blocks (swap-outs) sets ``before_write`` to wait for them, and
      must not promote while it holds planned but unissued reads (the decode engine promotes
      between steps only, ``KVCacheManager.promote_on_match``).
    """

    __slots__ = (
        "before_write", "bytes_per_block", "device_tensor", "disk", "disk_hits", "host_tensor",
        "sink", "tier",
    )  # fmt: skip

    def __init__(
        self,
        spec: KVCacheSpec,
        device_tensor: torch.Tensor,
        num_slots: int,
        *,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.HITS,
        pin_memory: bool | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        pin = device_tensor.is_cuda if pin_memory is None else pin_memory
        # NOTE: `empty`: a slot is always written by an offload before a promotion reads it,
        # and untouched pages of an unpinned tensor are not committed.
        self.host_tensor = torch.empty(
            spec.storage_shape(num_slots), dtype=spec.storage_dtype, device="cpu", pin_memory=pin
        )
        self.device_tensor = device_tensor
        self.tier = HostTier(num_slots, eviction_policy=eviction_policy)
        self.bytes_per_block = spec.bytes_per_block
        # NOTE: the decode engine sets it to `Swapper.wait_for_writes`: a pending swap-out may
        # still read a device block that a promotion is about to overwrite.
        self.before_write: Callable[[list[BlockId]], object] | None = None
        # NOTE: the disk tier (--kv-offload-dir) takes the blocks the host tier evicts.
        self.disk = disk
        self.disk_hits = 0
        # NOTE: the pool's event log (`attach`): the tiers' moves reach the prefix index in
        # order with the device's events (docs/prefix_index.md, "Tiers").
        self.sink: EventSink | None = None
        self.tier.on_evict = self._host_evicted
        if disk is not None:
            disk.on_dropped = self._disk_dropped

    @property
    def num_slots(self) -> int:
        return self.tier.num_slots

    # -- TierListener ---------------------------------------------------------------------

    def attach(self, sink: EventSink) -> None:
        """Record the tiers' moves into ``sink`` (the pool's event log; ``BlockPool.set_tier``)."""
        self.sink = sink

    def evicted(self, block_id: BlockId, block_hash: BlockHash, depth: int) -> bool:
        """Copy the evicted device block into a host slot (complete on return); whether the
        tier kept it (then recorded as STORED in tier ``host``)."""
        slot = self.tier.store(block_hash, depth)
        if slot is None:
            return False
        self._copy(self.device_tensor, self.host_tensor, [(block_id, slot)])
        self._emit(BlockEventKind.STORED, block_hash, Tier.HOST)
        return True

    def stored(self, block_hash: BlockHash) -> None:
        # NOTE: no event: the pool recorded STORED on the device, which moves the entry.
        self.tier.discard(block_hash)
        if self.disk is not None:
            self.disk.discard(block_hash)

    def reset(self) -> None:
        held = self.tier.hashes()
        self.tier.clear()
        for block_hash in held:
            self._emit(BlockEventKind.REMOVED, block_hash, Tier.HOST)
        if self.disk is not None:
            self.disk.clear()  # NOTE: its blocks are recorded REMOVED by `_disk_dropped`

    def _host_evicted(self, slot: SlotId, block_hash: BlockHash) -> None:
        """The host tier is about to reuse ``slot``: hand its block to the disk tier (its
        bytes are copied out now; the writer thread writes them), else it is gone."""
        kept = False
        if self.disk is not None:
            data = self.host_tensor[slot].reshape(-1).view(torch.uint8).numpy().tobytes()
            kept = self.disk.put(block_hash, data)
        if kept:
            self._emit(BlockEventKind.STORED, block_hash, Tier.DISK)
        else:
            self._emit(BlockEventKind.REMOVED, block_hash, Tier.HOST)

    def _disk_dropped(self, hashes: list[BlockHash]) -> None:
        """The disk tier forgot ``hashes`` (a file evicted, corrupt or cleared)."""
        for block_hash in hashes:
            self._emit(BlockEventKind.REMOVED, block_hash, Tier.DISK)

    def _emit(self, kind: BlockEventKind, block_hash: BlockHash, tier: Tier) -> None:
        if self.sink is not None:
            self.sink(kind, block_hash, tier)

    def held_hashes(self) -> dict[BlockHash, Tier]:
        """Every hash the host and disk tiers hold, with its tier."""
        held = dict.fromkeys(self.tier.hashes(), Tier.HOST)
        if self.disk is not None:
            held.update(dict.fromkeys(self.disk.hashes(), Tier.DISK))
        return held

    def close(self) -> None:
        """Write the disk tier's queued blocks and release its directory (no-op without)."""
        if self.disk is not None:
            self.disk.close()

    # -- promotion ------------------------------------------------------------------------

    def promote(
        self, pool: BlockPool, block_hashes: Sequence[BlockHash], matched: Sequence[BlockId]
    ) -> int:
        """Copy the host-held run of ``block_hashes`` that follows the device's ``matched``
        blocks, then the disk-held run after it, back into device blocks, registered (CACHED,
        ref 0) at their depths; returns how many. ``block_hashes`` ends at the match limit.
        The matched blocks are pinned meanwhile, the wanted host slots are pinned and the
        disk blocks are read (and checked) before the allocation, so the allocation (which
        may evict other cached device blocks into the tiers) displaces none of them. Fewer
        allocatable device blocks than wanted, or a corrupt disk block, promote a shorter run."""
        start = len(matched)
        host = self._run(block_hashes, start, self.tier)
        disk = self._run(block_hashes, start + host, self.disk) if self.disk else 0
        if host + disk == 0:
            return 0
        self.tier.stats.hits += host
        self.disk_hits += disk
        hashes = list(block_hashes[start : start + host])
        slots = [self.tier.pin(block_hash) for block_hash in hashes]
        pool.acquire(matched, hit=False)
        new: list[BlockId] = []
        done = 0
        try:
            room = pool.num_allocatable - host
            blocks = self._read_disk(block_hashes[start + host : start + host + disk], room)
            new = pool.allocate(min(host + len(blocks), pool.num_allocatable)) or []
            if new and self.before_write is not None:
                self.before_write(new)
            self._copy(self.host_tensor, self.device_tensor, list(zip(slots, new, strict=False)))
            self._write_disk_blocks(new[host:], blocks)
            hashes += block_hashes[start + host : start + host + len(blocks)]
            for block_hash, block_id in zip(hashes, new, strict=False):
                if done < host:
                    self.tier.take(block_hash)
                elif self.disk is not None:
                    self.disk.take(block_hash)
                pool.cache_block(block_id, block_hash, depth=start + done)
                done += 1
        finally:
            for block_hash in hashes[done:host]:
                self.tier.unpin(block_hash)
            pool.free([*reversed(new), *reversed(matched)])
        return done

    @staticmethod
    def _run(block_hashes: Sequence[BlockHash], start: int, tier: HostTier | DiskTier) -> int:
        """How many of ``block_hashes[start:]`` in a row ``tier`` holds."""
        n = 0
        while start + n < len(block_hashes) and block_hashes[start + n] in tier:
            n += 1
        return n

    def _read_disk(self, hashes: Sequence[BlockHash], room: int) -> list[bytearray]:
        """The checked bytes of the leading run of ``hashes`` (at most ``room``) the disk
        tier can read; empty when there is no room (the host run comes first)."""
        blocks: list[bytearray] = []
        if self.disk is None:
            return blocks
        for block_hash in hashes[: max(room, 0)]:
            data = self.disk.read(block_hash)
            if data is None:  # NOTE: corrupt (dropped and counted): the rest is recomputed
                break
            blocks.append(data)
        return blocks

    def _write_disk_blocks(self, block_ids: Sequence[BlockId], blocks: list[bytearray]) -> None:
        cuda = self.device_tensor.is_cuda
        for block_id, data in zip(block_ids, blocks, strict=False):
            if not cuda:
                _byte_view(self.device_tensor[block_id])[:] = memoryview(data)
                continue
            dst = self.device_tensor[block_id].view(-1).view(torch.uint8)
            dst.copy_(torch.frombuffer(data, dtype=torch.uint8))
        if block_ids and blocks and cuda:
            torch.cuda.current_stream().synchronize()

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if not (src.is_cuda or dst.is_cuda):
            for s, d in pairs:
                _byte_view(dst[d])[:] = _byte_view(src[s])
            return
        swap_blocks(src, dst, pairs)
        torch.cuda.current_stream().synchronize()

    # -- metrics and integrity ------------------------------------------------------------

    def counts(self) -> OffloadCounts:
        """The tier's metrics: monotonic counters (blocks, bytes) and its occupancy."""
        stats = self.tier.stats
        return OffloadCounts(
            writes=stats.writes,
            write_bytes=stats.writes * self.bytes_per_block,
            hits=stats.hits,
            promotions=stats.promotions,
            promotion_bytes=stats.promotions * self.bytes_per_block,
            evictions=stats.evictions,
            blocks_cached=self.tier.num_cached,
            blocks_total=self.tier.num_slots,
            **(self._disk_counts() if self.disk is not None else {}),
        )

    def _disk_counts(self) -> dict[str, int]:
        assert self.disk is not None
        stats, per_block = self.disk.stats, self.bytes_per_block
        return {
            "disk_writes": stats.writes,
            "disk_write_bytes": stats.writes * per_block,
            "disk_hits": self.disk_hits,
            "disk_promotions": stats.promotions,
            "disk_promotion_bytes": stats.promotions * per_block,
            "disk_evictions": stats.evictions,
            "disk_dropped": stats.dropped,
            "disk_corrupt_files": stats.corrupt_files,
            "disk_blocks_cached": self.disk.num_blocks,
            "disk_bytes_used": self.disk.bytes_used,
            "disk_capacity_bytes": self.disk.capacity_bytes,
        }

    def check_integrity(self, pool: BlockPool) -> None:
        """The tiers' own invariants plus: a hash is in at most one of ``pool``, the host
        tier and the disk tier."""
        self.tier.check_integrity()
        device = pool.registered_hashes()
        check_tiers_disjoint(device, self.tier)
        if self.disk is not None:
            self.disk.check_integrity()
            lower = [h for h in [*device, *self.tier.hashes()] if h in self.disk]
            if lower:
                raise RuntimeError(
                    f"integrity: {len(lower)} hashes in both the disk tier and a tier above it"
                )


def check_offload_config(
    num_slots: int,
    tensor_parallel_size: int,
    disk_dir: str | None = None,
    disk_bytes: int = 0,
) -> None:
    """ValueError naming the flag for a negative size, or a tier with more than one
    tensor-parallel rank (each rank's shard would need its own tier; not built), or a disk
    tier (``disk_dir``, ``disk_bytes``) given half, without the host tier above it, or at a
    path that is not a directory. Engine configs call it at construction, before any rank
    process starts; the directory itself is opened (created, locked) when the tier is built."""
    if num_slots < 0:
        raise ValueError(f"kv-offload-memory: must be >= 0 blocks, got {num_slots}")
    if num_slots > 0 and tensor_parallel_size > 1:
        raise ValueError(
            "kv-offload-memory: the host KV tier is not supported with --tensor-parallel-size "
            "above 1 (supported: 1, or --kv-offload-memory 0)"
        )
    check_disk_config(num_slots, tensor_parallel_size, disk_dir, disk_bytes)


def make_offload(
    spec: KVCacheSpec,
    device_tensor: torch.Tensor,
    num_slots: int,
    *,
    tensor_parallel_size: int = 1,
    eviction_policy: EvictionPolicy | str = EvictionPolicy.HITS,
    disk_plan: DiskPlan | None = None,
) -> KVOffload | None:
    """An engine's host tier of ``num_slots`` blocks, or None for 0 (``check_offload_config``
    errors otherwise), with the disk tier ``disk_plan`` asks for below it."""
    plan = disk_plan or DiskPlan(None, 0)
    check_offload_config(num_slots, tensor_parallel_size, plan.directory, plan.capacity_bytes)
    if num_slots == 0:
        return None
    disk = None
    if plan.directory:
        disk = DiskTier(
            plan.directory,
            plan.capacity_bytes,
            bytes_per_block=spec.bytes_per_block,
            compat_key=plan.compat_key,
        )
    return KVOffload(spec, device_tensor, num_slots, eviction_policy=eviction_policy, disk=disk)


class TierFields(Protocol):
    """The engine-config fields the prefix cache and its host and disk tiers are built from
    (both workers' engine configs have them)."""

    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def kv_offload_blocks(self) -> int: ...
    @property
    def kv_offload_dir(self) -> str | None: ...
    @property
    def kv_offload_disk_bytes(self) -> int: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def eviction_policy(self) -> EvictionPolicy: ...


def kv_cache_manager(
    pool: BlockPool,
    spec: KVCacheSpec,
    device_tensor: torch.Tensor,
    config: TierFields,
    model_fingerprint: bytes = b"",
) -> KVCacheManager:
    """An engine's manager of `pool`, with the host (and disk) tier `config` asks for (none
    without prefix caching). `model_fingerprint` (the block hashes') enters the disk files'
    compat key, so a worker of another model, dtype or layout ignores them."""
    caching = config.enable_prefix_caching
    offload = make_offload(
        spec,
        device_tensor,
        config.kv_offload_blocks if caching else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        eviction_policy=config.eviction_policy,
        disk_plan=DiskPlan(
            config.kv_offload_dir if caching else None,
            config.kv_offload_disk_bytes if caching else 0,
            layout_compat_hash(spec, model_fingerprint, config.tensor_parallel_size),
        ),
    )
    return KVCacheManager(pool, enable_prefix_caching=caching, offload=offload)
