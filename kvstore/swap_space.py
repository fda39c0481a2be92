"""SwapSpace: the host (CPU) page tensor that preempted sequences' KV blocks are swapped into.

It mirrors the device `KVCache` block for block: same `KVCacheSpec`, same block-major layout, so
moving a block between the two is one contiguous copy::

    device KVCache.tensor [num_device_blocks, L, 2, bs, H, D]
                                    │  swap out (device → host) / swap in (host → device)
    SwapSpace.tensor      [num_host_blocks,   L, 2, bs, H, D]   pinned when CUDA is available

Host block ids come from the swap space's own `BlockPool` (no hashing, no events): the decode
scheduler allocates and frees them; the `Swapper` copies the bytes.
"""

from __future__ import annotations

import torch

from pagedserve.kvstore.block_pool import BlockId, BlockPool
from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec

GIB = 1 << 30


def swap_blocks_for(spec: KVCacheSpec, swap_space_gib: float) -> int:
    """How many blocks of `spec` fit in `swap_space_gib` GiB of host memory (at least 0)."""
    if swap_space_gib < 0:
        raise ValueError(f"swap_space_gib: must be >= 0, got {swap_space_gib}")
    return spec.num_blocks_for(int(swap_space_gib * GIB))


class SwapSpace:
    """Owns `num_blocks` host blocks: their tensor and the pool that hands out their ids.

    Contracts:
    - Every `allocate` is matched by one `free` per block id (the scheduler that swapped a
      sequence out frees its host blocks when it is swapped in, aborted or recomputed).
    - The tensor is never reallocated; the swapper may hold it for the life of the space.
    - `pin_memory=None` pins exactly when CUDA is available (pinned memory makes host↔device
      copies asynchronous; pinning without CUDA is an error in torch).
    - Unpinned, the tensor is reserved, not committed: its pages become resident as blocks are
      first swapped into, so an idle swap space costs address space, not memory. Pinned memory
      is committed up front (page-locked), which is why the worker sizes it from its KV budget.
    """

    __slots__ = ("cache", "pool")

    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, pin_memory: bool | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: swap space needs >= 1 block, got {num_blocks}")
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        shape = spec.storage_shape(num_blocks)
        # NOTE: `empty`, not `zeros`: zero-filling would touch (commit) every page at start, and
        # a host block is always written by a swap-out before a swap-in reads it.
        tensor = torch.empty(shape, dtype=spec.storage_dtype, device="cpu", pin_memory=pin)
        self.cache = KVCache(spec, num_blocks, "cpu", tensor=tensor)
        self.pool = BlockPool(num_blocks, spec.block_size, record_events=False)

    @classmethod
    def from_gib(cls, spec: KVCacheSpec, swap_space_gib: float) -> SwapSpace | None:
        """A swap space of `swap_space_gib` GiB, or None when not even one block fits."""
        num_blocks = swap_blocks_for(spec, swap_space_gib)
        return cls(spec, num_blocks) if num_blocks > 0 else None

    @property
    def spec(self) -> KVCacheSpec:
        return self.cache.spec

    @property
    def tensor(self) -> torch.Tensor:
        return self.cache.tensor

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def is_pinned(self) -> bool:
        return self.tensor.is_pinned()

    def can_allocate(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """`num_blocks` host block ids, or None (changing nothing) when the space is short."""
        return self.pool.allocate(num_blocks)

    def free(self, block_ids: list[BlockId]) -> None:
        self.pool.free(block_ids)

    def check_integrity(self) -> None:
        """Raise RuntimeError on broken bookkeeping; host blocks never carry hashes."""
        self.pool.check_integrity()
        if self.pool.num_cached:
            raise RuntimeError(f"integrity: swap space has {self.pool.num_cached} cached blocks")
