"""Triton PagedAttention: varlen causal attention of new tokens over a paged KV cache.

One kernel serves decode (one query per sequence), prefill over a cached prefix and chunked
prefill. Each program owns one sequence, one KV head and one tile of query rows; the rows are
(token, query head of this KV head's group) pairs, so GQA of any ratio loads each K/V tile once:

    rows:  | t0 h0 | t0 h1 | .. | t0 h(R-1) | t1 h0 | .. |    R = num_heads // num_kv_heads
    keys:  tiles of TILE_N context positions; tile position n lives in block
           block_tables[seq, n // BLOCK_SIZE] at offset n % BLOCK_SIZE (any block size, even 1)

Split-K (flash-decoding): the key range of a query tile is cut into NUM_SPLITS parts run by
separate programs; each writes a normalised partial output and its log-sum-exp, and
`_reduce_splits_kernel` merges them. It pays off for few, long sequences.

Soft-capping (Gemma 2): with SOFTCAP each logit is scale * q . k capped to
softcap * tanh(logit / softcap) before the mask, tanh written with exp2 (no tanh in `tl.math`;
the same code compiled and interpreted). Without it the kernel is the uncapped one (a constexpr).

Every tensor is addressed through its strides, so the per-layer K/V views of the block-major pool
(`KVCache.layer`) are read in place. The caller guarantees: this step's K/V are already in the
cache, `seq_lens[i] >= query_lens[i] >= 1`, block tables cover `seq_lens`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale_log2,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    RATIO: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # context position of this sequence's first query

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // RATIO
    head = kv_head * RATIO + rows % RATIO
    row_ok = (rows < BLOCK_Q * RATIO) & (tok < q_len)
    q_pos = first_pos + tok
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(DOT_DTYPE)

    # NOTE: the keys this tile can see: [k_lo, k_hi) = window start of its first query .. its
    # last query's own position; split s takes an equal share of those TILE_N-aligned tiles.
    k_hi = first_pos + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    k_lo = 0
    if WINDOW > 0:
        k_lo = tl.maximum(first_pos + q_tile * BLOCK_Q - WINDOW + 1, 0)
    tile_lo = k_lo // TILE_N
    num_tiles = tl.cdiv(k_hi, TILE_N) - tile_lo
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_lo + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        n = t * TILE_N + tl.arange(0, TILE_N)
        n_ok = (n >= k_lo) & (n < k_hi)
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_kt + kv_head * stride_kh
        kv_mask = n_ok[None, :] & dim_ok[:, None]
        k = tl.load(k_ptr + k_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        if SOFTCAP:
            # scale_log2 is scale here: logit = softcap * tanh(x), x = scale * q . k / softcap;
            # tanh |x| = (1 - e) / (1 + e), e = exp(-2 |x|) in (0, 1]: no overflow, no NaN
            x = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale_log2 / softcap
            e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
            tanh = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -tanh, tanh) * (softcap * LOG2E)
        else:
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale_log2
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + slot * stride_vt + kv_head * stride_vh
        v = tl.load(
            v_ptr + v_off[:, None] + dims[None, :], mask=n_ok[:, None] & dim_ok[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tok64 = (q_start + tok).to(tl.int64)
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        o_off = tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        p_row = tok64 * stride_pt + head * stride_ph + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + p_row, lse, mask=row_ok)
        tl.store(part_out_ptr + p_row[:, None] * HEAD_DIM + dims[None, :], out, mask=io_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    p_row = token * stride_pt + head * stride_ph + splits
    lse = tl.load(part_lse_ptr + p_row, mask=splits < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - m)
    mask = (splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :]
    part = tl.load(part_out_ptr + p_row[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    o_off = token * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _dot_dtype(dtype: torch.dtype, interp: bool) -> tl.dtype:
    # NOTE: the Triton 3.9 interpreter multiplies bf16 tiles as raw integers; on CPU the dots run
    # in fp32 instead (the GPU keeps bf16 operands with fp32 accumulation).
    if dtype == torch.float32 or (interp and dtype == torch.bfloat16):
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("query, k_cache, v_cache: head_dim must be the contiguous dimension")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads {query.shape[1]} not a multiple of {k_cache.shape[2]}")


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split-K factor for decode: enough programs to fill the GPU, never splits under 256 keys."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * sms, programs)
    return max(1, min(want, max_seq_len // 256, 16))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened varlen batch of queries over the paged cache.

    query [num_tokens, num_heads, head_dim]; k_cache/v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] (any strides with a contiguous head_dim); block_tables
    [num_seqs, max_blocks] (int32/int64); query_start_loc [num_seqs + 1] and seq_lens
    [num_seqs] int32 on the query's device. Returns a new tensor shaped like `query`.
    `softcap` (> 0): logits capped to softcap * tanh(logit / softcap); None: none.
    """
    _check_layout(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    ratio = num_heads // num_kv_heads
    interp = _interpreting()
    is_decode = max_query_len == 1
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # NOTE: prefill tiles of 64 rows at head_dim 256 (Gemma) would hold q and acc at 64 x 256
    # fp32 each (64 KiB of shared memory for q alone): 32 rows there
    prefill_m = 128 if interp else (64 if head_dim_pad <= 128 else 32)
    block_m = max(16 if is_decode else prefill_m, triton.next_power_of_2(ratio))
    block_q = block_m // ratio
    tile_n = 64 if interp or head_dim_pad <= 64 else 32
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    part_out = part_lse = out  # placeholders, unused without split-K
    if num_splits > 1:
        part_lse = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q) * num_splits)
    _paged_attention_kernel[grid](
        out,
        part_out,
        part_lse,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale if softcap else scale * LOG2E,
        softcap or 1.0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_lse.stride(0),
        part_lse.stride(1),
        RATIO=ratio,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        WINDOW=sliding_window or 0,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_DTYPE=_dot_dtype(query.dtype, interp),
        SOFTCAP=bool(softcap),
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            part_lse.stride(0),
            part_lse.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence: query [num_seqs, num_heads, head_dim]."""
    query_start_loc = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        1,
        scale,
        sliding_window,
        num_splits,
        softcap,
    )
