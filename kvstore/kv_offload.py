"""KVOffload: the host-memory tier's tensor and copies (``--kv-offload-memory``).

The device pool's ``BlockPool`` calls it (``TierListener``) as it evicts a cached block; it
copies the block's KV into a host slot that ``HostTier`` registers under the block's hash::

    device KVCache.tensor [num_blocks, ...] ──evicted(block)──► host tensor [num_slots, ...]
                          ▲                                              │
                          └────────── promote (KVCacheManager.match_prefix) ┘

The copies use the swap path's kernel (``kernels.dispatch.swap_blocks``). On CPU both pools are
RAM and a copy is complete on return. On CUDA the copies are issued on the current stream and
the stream is synchronised after each batch.

NOTE: synchronous by design for now: an eviction happens inside ``BlockPool.allocate``, and
the block it frees may be written at once by whoever allocated it (a forward, a swap-in or a
KV import on another thread), so the copy out must be complete before ``allocate`` returns.
Overlapping it with compute (the swapper's copy thread and ``wait_for_writes``) is not built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pagedserve.kernels.dispatch import swap_blocks
from pagedserve.kvstore.block_pool import BlockId, BlockPool
from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.host_tier import HostTier, OffloadCounts, check_tiers_disjoint
from pagedserve.kvstore.kv_cache import KVCacheSpec
from pagedserve.kvstore.kv_cache_manager import KVCacheManager


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

    __slots__ = ("before_write", "bytes_per_block", "device_tensor", "host_tensor", "tier")

    def __init__(
        self,
        spec: KVCacheSpec,
        device_tensor: torch.Tensor,
        num_slots: int,
        *,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.HITS,
        pin_memory: bool | None = None,
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

    @property
    def num_slots(self) -> int:
        return self.tier.num_slots

    # -- TierListener ---------------------------------------------------------------------

    def evicted(self, block_id: BlockId, block_hash: BlockHash, depth: int) -> None:
        """Copy the evicted device block into a host slot (complete on return)."""
        slot = self.tier.store(block_hash, depth)
        if slot is not None:
            self._copy(self.device_tensor, self.host_tensor, [(block_id, slot)])

    def stored(self, block_hash: BlockHash) -> None:
        self.tier.discard(block_hash)

    def reset(self) -> None:
        self.tier.clear()

    # -- promotion ------------------------------------------------------------------------

    def promote(
        self, pool: BlockPool, block_hashes: Sequence[BlockHash], matched: Sequence[BlockId]
    ) -> int:
        """Copy the host-held run of ``block_hashes`` that follows the device's ``matched``
        blocks back into device blocks, registered (CACHED, ref 0) at their depths; returns how
        many. ``block_hashes`` ends at the match limit. The matched blocks are pinned meanwhile
        and the wanted host slots are pinned, so the allocation (which may evict other cached device
        blocks into the tier) displaces neither. Fewer allocatable device blocks than wanted
        promote a shorter run."""
        start = len(matched)
        wanted = 0
        while start + wanted < len(block_hashes) and block_hashes[start + wanted] in self.tier:
            wanted += 1
        if wanted == 0:
            return 0
        self.tier.stats.hits += wanted
        hashes = block_hashes[start : start + wanted]
        slots = [self.tier.pin(block_hash) for block_hash in hashes]
        pool.acquire(matched, hit=False)
        new: list[BlockId] = []
        done = 0
        try:
            new = pool.allocate(min(wanted, pool.num_allocatable)) or []
            if new and self.before_write is not None:
                self.before_write(new)
            self._copy(self.host_tensor, self.device_tensor, list(zip(slots, new, strict=False)))
            for block_hash, block_id in zip(hashes, new, strict=False):
                self.tier.take(block_hash)
                pool.cache_block(block_id, block_hash, depth=start + done)
                done += 1
        finally:
            for block_hash in hashes[done:]:
                self.tier.unpin(block_hash)
            pool.free([*reversed(new), *reversed(matched)])
        return done

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        swap_blocks(src, dst, pairs)
        if src.is_cuda or dst.is_cuda:
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
        )

    def check_integrity(self, pool: BlockPool) -> None:
        """The tier's own invariants plus: no hash in both ``pool`` and the tier."""
        self.tier.check_integrity()
        check_tiers_disjoint(pool.registered_hashes(), self.tier)


def check_offload_config(num_slots: int, tensor_parallel_size: int) -> None:
    """ValueError naming the flag for a negative size, or a tier with more than one
    tensor-parallel rank (each rank's shard would need its own tier; not built). Engine
    configs call it at construction, before any rank process starts."""
    if num_slots < 0:
        raise ValueError(f"kv-offload-memory: must be >= 0 blocks, got {num_slots}")
    if num_slots > 0 and tensor_parallel_size > 1:
        raise ValueError(
            "kv-offload-memory: the host KV tier is not supported with --tensor-parallel-size "
            "above 1 (supported: 1, or --kv-offload-memory 0)"
        )


def make_offload(
    spec: KVCacheSpec,
    device_tensor: torch.Tensor,
    num_slots: int,
    *,
    tensor_parallel_size: int = 1,
    eviction_policy: EvictionPolicy | str = EvictionPolicy.HITS,
) -> KVOffload | None:
    """An engine's host tier of ``num_slots`` blocks, or None for 0 (``check_offload_config``
    errors otherwise)."""
    check_offload_config(num_slots, tensor_parallel_size)
    if num_slots == 0:
        return None
    return KVOffload(spec, device_tensor, num_slots, eviction_policy=eviction_policy)


class TierFields(Protocol):
    """The engine-config fields the prefix cache and its host tier are built from (both
    workers' engine configs have them)."""

    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def kv_offload_blocks(self) -> int: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def eviction_policy(self) -> EvictionPolicy: ...


def kv_cache_manager(
    pool: BlockPool, spec: KVCacheSpec, device_tensor: torch.Tensor, config: TierFields
) -> KVCacheManager:
    """An engine's manager of `pool`, with the host tier `config` asks for (none without
    prefix caching)."""
    offload = make_offload(
        spec,
        device_tensor,
        config.kv_offload_blocks if config.enable_prefix_caching else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        eviction_policy=config.eviction_policy,
    )
    return KVCacheManager(pool, enable_prefix_caching=config.enable_prefix_caching, offload=offload)
