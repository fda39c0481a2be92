"""Swap gather/scatter: whole blocks between a device pool and a host (swap-space) pool.

Both pools have one `KVCacheSpec` (block-major pages, each block one contiguous run of bytes), so
a run of consecutive block ids is one memcpy. Torch copies are already optimal here: on CUDA a
device <-> pinned-host copy is a DMA (`cudaMemcpyAsync`), which a kernel could not beat.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs where both ids advance by one: each run is one memcpy."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """Copy whole blocks between two pools of one spec (device <-> host): `dst[d] = src[s]`.

    Between a CUDA pool and pinned host memory the copies are asynchronous on the current
    stream: the caller records an event (or synchronises) before reading `dst_cache` or reusing
    the source blocks. Between CPU pools the copy is complete on return.
    """
    if not pairs:
        return
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise ValueError(
            f"swap_blocks: pools differ: {tuple(src_cache.shape)} {src_cache.dtype} vs "
            f"{tuple(dst_cache.shape)} {dst_cache.dtype}"
        )
    if src_cache.device == dst_cache.device:
        src = torch.tensor([s for s, _ in pairs], device=src_cache.device)
        dst = torch.tensor([d for _, d in pairs], device=dst_cache.device)
        dst_cache.index_copy_(0, dst, src_cache.index_select(0, src))
        return
    non_blocking = src_cache.is_pinned() or dst_cache.is_pinned()
    for src_id, dst_id, length in _runs(pairs):
        dst_cache[dst_id : dst_id + length].copy_(
            src_cache[src_id : src_id + length], non_blocking=non_blocking
        )
