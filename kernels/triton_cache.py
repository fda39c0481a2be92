"""Triton cache operations on the block-major KV pool: cache write and copy-on-write block copy.

    pool  [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (kvstore/kv_cache.py)
    layer view k/v  [num_blocks, block_size, num_kv_heads, head_dim]        (strided, no copy)

Swapping between a device pool and a host pool is a plain copy, in `kernels/swap.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    toks = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
    ok = slot >= 0  # NOTE: a negative slot is a padding token: nothing is written for it
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = ok[:, None, None] & (heads < NUM_KV_HEADS)[None, :, None]
    mask = mask & (dims < HEAD_DIM)[None, None, :]
    toks64 = toks.to(tl.int64)[:, None, None]
    src_k = toks64 * stride_kt + heads[None, :, None] * stride_kh + dims[None, None, :]
    src_v = toks64 * stride_vt + heads[None, :, None] * stride_vh + dims[None, None, :]
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    dst_k = (block * stride_kcb + offset * stride_kct)[:, None, None]
    dst_v = (block * stride_vcb + offset * stride_vct)[:, None, None]
    dst_k = dst_k + heads[None, :, None] * stride_kch + dims[None, None, :]
    dst_v = dst_v + heads[None, :, None] * stride_vch + dims[None, None, :]
    tl.store(k_cache_ptr + dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    pairs_ptr,
    stride_b,
    block_numel,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    mask = offs < block_numel
    data = tl.load(cache_ptr + src * stride_b + offs, mask=mask)
    tl.store(cache_ptr + dst * stride_b + offs, data, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into `slot_mapping` (in place).

    Slot = block_id * block_size + offset; negative slots are skipped. Values are cast to the
    cache dtype. The caches may be strided views; head_dim must be contiguous everywhere.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("reshape_and_cache: head_dim must be the contiguous dimension")
    if num_tokens == 0:
        return
    if triton.knobs.runtime.interpret and key.dtype != k_cache.dtype:
        # NOTE: the Triton 3.9 interpreter rounds fp32 -> bf16 toward zero (GPUs round to
        # nearest even), so under it the cast happens here, in torch.
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    tokens = 16
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, tokens),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        TOKENS=tokens,
    )


def _check_pairs(pairs: Sequence[tuple[int, int]], num_blocks: int) -> None:
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts) or set(srcs) & set(dsts):
        raise ValueError(f"pairs: destinations must be distinct and never a source, got {pairs}")
    if min(srcs + dsts) < 0 or max(srcs + dsts) >= num_blocks:
        raise ValueError(f"pairs: block ids must be in [0, {num_blocks}), got {pairs}")


def copy_blocks(cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy whole blocks `src -> dst` (every layer, K and V) within one pool, in place.

    `cache` is the pool [num_blocks, ...] with contiguous pages (only dim 0 may be strided).
    All copies run concurrently, so destinations must be distinct and never a source (true of
    copy-on-write, whose destinations are freshly allocated); else `ValueError`.
    """
    if not pairs:
        return
    _check_pairs(pairs, cache.shape[0])
    pages = cache.flatten(1)
    if pages.data_ptr() != cache.data_ptr() or pages.stride(1) != 1:
        raise ValueError("copy_blocks: each block of `cache` must be contiguous")
    pair_tensor = torch.tensor(pairs, dtype=torch.int64).to(cache.device, non_blocking=True)
    block_numel = pages.shape[1]
    chunk = 4096
    grid = (len(pairs), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](pages, pair_tensor, pages.stride(0), block_numel, CHUNK=chunk)
