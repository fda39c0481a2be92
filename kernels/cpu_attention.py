"""The CPU fast path for paged attention (the winner of the candidates in docs/kernels.md).

Per sequence: gather its blocks into a reused per-thread workspace (`index_select(out=)`, no
allocation), then one `scaled_dot_product_attention`. Decode packs each KV head's query heads
as query rows, so K/V are read once per group instead of once per query head:

    query [num_heads, D] -> [num_kv_heads, R, D]   (R = num_heads // num_kv_heads, no mask needed)
    keys  gathered [L, num_kv_heads, D] -> [num_kv_heads, L, D] (a strided view, not a copy)

NOTE: allocating the gather buffer per call costs as much as the attention itself on small
machines (fresh pages fault in), hence the workspace. It grows to the longest context seen,
per thread, and is never shrunk: about 2 * max_seq_len * num_kv_heads * head_dim elements.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedserve.kernels import reference

_local = threading.local()


def _workspace(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two buffers [>= num_blocks, block_size, num_kv_heads, head_dim] of this thread."""
    key = (cache.dtype, cache.device, tuple(cache.shape[1:]))
    bufs: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]]
    bufs = _local.__dict__.setdefault("bufs", {})
    got = bufs.get(key)
    if got is None or got[0].shape[0] < num_blocks:
        size = max(num_blocks, 2 * got[0].shape[0] if got is not None else 0)
        shape = (size, *cache.shape[1:])
        got = (
            torch.empty(shape, dtype=cache.dtype, device=cache.device),
            torch.empty(shape, dtype=cache.dtype, device=cache.device),
        )
        bufs[key] = got
    return got


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, first: int, last: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [last - first, num_kv_heads, head_dim] of context positions [first, last)."""
    block_size = k_cache.shape[1]
    lo, hi = first // block_size, -(-last // block_size)
    kbuf, vbuf = _workspace(k_cache, hi - lo)
    ids = block_ids[lo:hi]
    key = torch.index_select(k_cache, 0, ids, out=kbuf[: hi - lo]).flatten(0, 1)
    value = torch.index_select(v_cache, 0, ids, out=vbuf[: hi - lo]).flatten(0, 1)
    start = first - lo * block_size
    return key[start : start + last - first], value[start : start + last - first]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query per sequence: query [num_seqs, num_heads, head_dim] -> same shape."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    packed = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(packed)
    for i, seq_len in enumerate(seq_lens):
        first = max(0, seq_len - sliding_window) if sliding_window else 0
        key, value = _gather(k_cache, v_cache, block_tables[i], first, seq_len)
        # NOTE: 4-D inputs: CPU SDPA takes its flash kernel only for 4-D (3-D falls back to math)
        out[i : i + 1] = F.scaled_dot_product_attention(
            packed[i : i + 1], key.transpose(0, 1)[None], value.transpose(0, 1)[None], scale=scale
        )
    return out.view(num_seqs, num_heads, head_dim)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention (prefill, chunks, decode mixed): same contract as the reference.

    Prefill is compute-bound, so it keeps the reference's per-sequence SDPA (with its masks)
    and only swaps the allocating gather for the workspace one.
    """
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        key, value = _gather(k_cache, v_cache, block_tables[i], 0, seq_len)
        end = start + q_len
        out[start:end] = reference.sequence_attention(
            query[start:end], key, value, scale, sliding_window
        )
        start = end
    return out
