"""The torch reference for every paged KV-cache operation: the single oracle.

Every optimised kernel (Triton, fast CPU paths) is tested against these functions; tests never
carry their own copy. They favour clarity over speed: attention loops over sequences and gathers
each sequence's blocks into a contiguous copy before calling `scaled_dot_product_attention`.

Shapes (see docs/kv_layout.md):
    k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]   (one layer's view)
    slot               block_id * block_size + offset_in_block
    block_tables       [num_seqs, max_blocks_per_seq] int32, rows padded with any valid id
    query_start_loc    [num_seqs + 1] cumulative query lengths of the flattened batch
    seq_lens           [num_seqs] tokens of context per sequence *including* this step's queries
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `key`/`value` [num_tokens, num_kv_heads, head_dim] into their slots (in place)."""
    block_size = k_cache.shape[1]
    block_idx = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offset = slot_mapping % block_size
    k_cache[block_idx, offset] = key.to(k_cache.dtype)
    v_cache[block_idx, offset] = value.to(v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K, V [seq_len, num_kv_heads, head_dim] of one sequence."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_blocks = -(-seq_len // k_cache.shape[1])
    ids = block_ids[:num_blocks]
    key = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    value = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return key, value


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with soft-capped logits, in transformers' eager order (Gemma 2):

        scores = tanh(((q . k) * scale) / softcap) * softcap,  masked,  softmax in float32,
        rounded to the query's dtype,  times V

    query [..., kv_heads, R, q_len, D] or [..., heads, q_len, D] with `key`/`value`
    [..., kv_heads, 1, ctx_len, D] or [..., heads, ctx_len, D] (broadcast); `mask` (True =
    attended) broadcasts to the scores [..., q_len, ctx_len]. Every row must attend a key.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def _causal_mask(
    q_len: int, ctx_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, ctx_len] bool, True = attended: query i at position ctx_len - q_len + i sees
    keys up to itself (with a window W, only the last W of them)."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last `q_len` positions of one sequence over its whole context.

    query [q_len, num_heads, head_dim]; key/value [ctx_len, num_kv_heads, head_dim] with
    ctx_len >= q_len: query i sits at position ctx_len - q_len + i and sees keys up to itself
    (and, with a sliding window W, only the last W of them). Returns [q_len, num_heads, head_dim].
    With `softcap`, the logits are soft-capped (`softcapped_attention`) before the mask.
    """
    q_len, ctx_len = query.shape[0], key.shape[0]
    if softcap is not None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        # [kv_heads, R, q_len, D] against [kv_heads, 1, ctx_len, D]: each K/V head read by its
        # group of query heads (transformers' repeat_kv, without the copy)
        q = query.transpose(0, 1).reshape(num_kv_heads, -1, q_len, head_dim)
        k, v = key.transpose(0, 1).unsqueeze(1), value.transpose(0, 1).unsqueeze(1)
        mask = _causal_mask(q_len, ctx_len, sliding_window, query.device)
        out = softcapped_attention(q, k, v, scale, softcap, mask)
        return out.reshape(-1, q_len, head_dim).transpose(0, 1)
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    windowed = sliding_window is not None and ctx_len > sliding_window
    if not windowed and q_len == ctx_len:
        out = F.scaled_dot_product_attention(
            q, k, v, scale=scale, is_causal=q_len > 1, enable_gqa=gqa
        )
    elif not windowed and q_len == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    else:
        mask = _causal_mask(q_len, ctx_len, sliding_window, query.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Varlen attention of a flattened batch over a paged cache: prefill, chunks and decode alike.

    query [num_tokens, num_heads, head_dim] holds each sequence's `query_lens[i]` new tokens in
    order; their K/V must already be in the cache (`write_kv`). Returns the same shape as `query`.
    `softcap` (Gemma 2's attn_logit_softcapping): see `softcapped_attention`; None: no capping.
    """
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        key, value = gather_kv(k_cache, v_cache, block_tables[i], seq_len)
        end = start + q_len
        out[start:end] = sequence_attention(
            query[start:end], key, value, scale, sliding_window, softcap
        )
        start = end
    return out


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [num_seqs, num_heads, head_dim]."""
    ones = [1] * len(seq_lens)
    return paged_attention(
        query, k_cache, v_cache, block_tables, ones, seq_lens, scale, sliding_window, softcap
    )


def copy_blocks(cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy whole blocks `src -> dst` along dim 0 of `cache` (copy-on-write), in place."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=cache.device)
    dst = torch.tensor([d for _, d in pairs], device=cache.device)
    cache[dst] = cache[src]


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """Copy blocks between two pools (device <-> host swap space): `dst[d] = src[s]`."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=src_cache.device)
    dst = torch.tensor([d for _, d in pairs], device=dst_cache.device)
    dst_cache[dst] = src_cache[src].to(dst_cache.device)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) symmetric int8: (codes [M, K] int8, scales [M] float32),
    `x ~= codes * scales[:, None]`, codes rounded half to even (csrc/quant_act.c)."""
    amax = x.abs().amax(dim=1).clamp_min(1e-30)
    codes = torch.round(x * (127.0 / amax)[:, None]).to(torch.int8)
    return codes, amax / 127.0


def w8a8_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`--quantization w8a8` in plain torch: x [M, K] float32 quantized per row, times int8
    codes [N, K] with one scale per output channel, the products summed exactly (int64 here,
    int32 in the kernel: |sum| < 127 * 127 * K), then `(sum * row scale) * channel scale`."""
    q, row_scales = quantize_rows_int8(x.float())
    acc = (q.to(torch.int64) @ codes.to(torch.int64).t()).to(torch.float32)
    out = acc * row_scales[:, None] * scales.float()[None, :]
    return out if bias is None else out + bias
