"""The CPU fast path for paged attention (the winner of the candidates in docs/kernels.md).

Decode is batched: `DecodeBuckets` (planned once per step, shared by every layer) sorts the
decode sequences into buckets of similar length, each small enough (`_BUCKET_BYTES` of K+V) for
SDPA to read its gather back from cache. Per bucket and layer: one `index_select` of all its
blocks into a reused per-thread workspace, then one 4-D `scaled_dot_product_attention` with a key
mask. Each KV head's query heads are packed as query rows, so K/V are read once per GQA group:

    query [n, num_heads, D] -> [n, num_kv_heads, R, D]        (R = num_heads // num_kv_heads)
    gathered [n * cols, block_size, num_kv_heads, D]
          -> [n, cols * block_size, num_kv_heads, D]           (sequence i's blocks, in order)
          -> keys [lo, hi) -> [n, num_kv_heads, hi - lo, D]    (a strided view, not a copy)

Sequence i attends gathered positions [first_i, end_i) of its row (sliding window included).
Positions outside it (the tail of a partial block, blocks past a shorter sequence) are zeroed in
the workspace and masked, so stale bytes of the pool (even NaN) never reach an output.

Prefill and chunked-prefill sequences keep the reference's per-sequence SDPA (compute-bound,
causal masks) with a workspace gather; decode sequences of a mixed batch take the batched path.

NOTE: allocating the gather buffer per call costs as much as the attention itself on small
machines (fresh pages fault in), hence the workspace. It grows to the largest gather seen, per
thread, and is never shrunk: about `_BUCKET_BYTES`, or one sequence's K/V of one layer when a
single sequence is larger than that.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native, native_plan, reference

_local = threading.local()

# NOTE: a bucket takes sequences down to half of its longest span; spans this short never split
# (one more gather + SDPA costs more than the padded positions it saves).
_MIN_SPLIT_SPAN = 256
# NOTE: and holds at most this many bytes of gathered K+V, so SDPA reads them back from cache:
# one big bucket that spills to DRAM measured 1.1-1.4x slower than the per-sequence loop at
# 32 heads / 8 KV heads / head_dim 128 (docs/kernels.md).
_BUCKET_BYTES = 4 << 20
# NOTE: fp16/bf16 buckets hold equal spans only (no padding, no mask): CPU SDPA rounds a padded,
# masked row one ulp away from the unpadded one, and greedy tokens must equal transformers'
# unpadded SDPA bit for bit (tests/model/test_oracle.py). fp32 differs by ~1e-7 relative.
_PADDED_DTYPES = (torch.float32, torch.float64)


def _workspace(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two buffers [>= num_blocks, block_size, num_kv_heads, head_dim] of this thread."""
    # NOTE: buffers made under inference mode cannot be written outside it, and vice versa
    # they may be: keyed by the mode, so a caller outside inference mode gets its own.
    key = (cache.dtype, cache.device, tuple(cache.shape[1:]), torch.is_inference_mode_enabled())
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


@dataclass(frozen=True, slots=True)
class _Bucket:
    """Decode sequences attended by one gather + one SDPA."""

    rows: torch.Tensor | None  # [n] int64 rows of `query` (and of the output); None: all, in order
    block_ids: torch.Tensor  # [n * cols] int64, sequence-major; padding repeats valid table ids
    cols: int  # blocks gathered per sequence
    keys: slice  # gathered positions [lo, hi) of a row that any sequence attends
    pad: torch.Tensor | None  # [p] int64 flat gathered positions to zero (row * cols * bs + pos)
    mask: torch.Tensor | None  # [n, 1, 1, hi - lo] bool, True = attended; None: all attended


@dataclass(frozen=True, slots=True)
class DecodeBuckets:
    """How the decode sequences of one step read the paged cache; valid for every layer.

    Build it with `plan_decode` once per step (dispatch caches it on `AttentionMetadata`); it
    depends on block tables, lengths, the cache layout (block size, row bytes, dtype) and the
    sliding window, never on a layer's values.
    """

    buckets: tuple[_Bucket, ...]
    num_rows: int  # rows of the query it was planned for


def plan_decode(
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    k_cache: torch.Tensor,
    sliding_window: int | None = None,
) -> DecodeBuckets:
    """Plan the sequences with one query token (`query_lens[i] == 1`) of a flattened batch.

    `k_cache` is any layer's view: only its block size, K/V row size and dtype are read (a
    bucket gathers at most `_BUCKET_BYTES` of K+V).

    Sequence i reads context positions [first_i, seq_len_i), first_i = seq_len_i - window when
    a window cuts it. Its gathered row starts at its block `first_i // block_size`.
    """
    rows, seqs, num_rows = native_plan.single_token_rows(query_lens)
    firsts = [max(0, seq_lens[i] - sliding_window) if sliding_window else 0 for i in seqs]
    spans = [seq_lens[i] - first for i, first in zip(seqs, firsts, strict=True)]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_positions = _BUCKET_BYTES // (2 * num_kv_heads * head_dim * k_cache.element_size())
    offsets = [first % block_size for first in firsts]
    order = sorted(range(len(seqs)), key=lambda j: (-spans[j], offsets[j]))
    padded = k_cache.dtype in _PADDED_DTYPES
    groups = _split_by_span(order, spans, offsets, max_positions, padded)
    # NOTE: one group holding every row (a decode-only batch) reads and writes rows in place
    in_place = len(groups) == 1 and len(seqs) == num_rows
    buckets = tuple(
        _plan_bucket(
            block_tables,
            None if in_place else [rows[j] for j in group],
            [seqs[j] for j in group],
            [firsts[j] for j in group],
            [seq_lens[seqs[j]] for j in group],
            block_size,
        )
        for group in groups
    )
    return DecodeBuckets(buckets, num_rows)


def _split_by_span(
    order: list[int], spans: list[int], offsets: list[int], max_positions: int, padded: bool
) -> list[list[int]]:
    """Cut `order` (longest span first) into buckets; see `_joins`.

    Each group comes back in batch order, so one group of a whole batch needs no row shuffle.
    """
    groups: list[list[int]] = []
    for j in order:
        if groups and _joins(groups[-1], j, spans, offsets, max_positions, padded):
            groups[-1].append(j)
        else:
            groups.append([j])
    return [sorted(group) for group in groups]


def _joins(
    group: list[int],
    j: int,
    spans: list[int],
    offsets: list[int],
    max_positions: int,
    padded: bool,
) -> bool:
    """Whether sequence j joins `group`, whose first member has the longest span."""
    longest = spans[group[0]]
    if (len(group) + 1) * longest > max_positions:
        return False
    if not padded:
        return (spans[j], offsets[j]) == (longest, offsets[group[0]])
    return longest < _MIN_SPLIT_SPAN or 2 * spans[j] >= longest


def _plan_bucket(
    block_tables: torch.Tensor,
    rows: list[int] | None,
    seqs: list[int],
    firsts: list[int],
    ends: list[int],
    block_size: int,
) -> _Bucket:
    #   gathered row of sequence i:  | block lo_i | lo_i + 1 | ... | lo_i + cols - 1 |
    #   attended positions:          [first_i - lo_i * bs, end_i - lo_i * bs)
    device = block_tables.device
    lo_blocks = [first // block_size for first in firsts]
    cols = max(-(-end // block_size) - lo for end, lo in zip(ends, lo_blocks, strict=True))
    starts = [first - lo * block_size for first, lo in zip(firsts, lo_blocks, strict=True)]
    stops = [end - lo * block_size for end, lo in zip(ends, lo_blocks, strict=True)]
    rows_t = None if rows is None else torch.tensor(rows, device=device)
    block_ids = _block_ids(block_tables, seqs, lo_blocks, cols)
    keys = slice(min(starts), max(stops))
    if keys.start == max(starts) and keys.stop == min(stops):
        return _Bucket(rows_t, block_ids, cols, keys, None, None)
    pos = torch.arange(keys.start, keys.stop, device=device)
    attended = (pos >= torch.tensor(starts, device=device)[:, None]) & (
        pos < torch.tensor(stops, device=device)[:, None]
    )
    seq_row, col = (~attended).nonzero(as_tuple=True)
    pad = seq_row * (cols * block_size) + keys.start + col
    return _Bucket(rows_t, block_ids, cols, keys, pad, attended[:, None, None, :])


def _block_ids(
    block_tables: torch.Tensor, seqs: list[int], lo_blocks: list[int], cols: int
) -> torch.Tensor:
    """[len(seqs) * cols] int64: table columns lo_i .. lo_i + cols - 1 of each sequence.

    Columns past a shorter sequence's end re-read a valid id of its row (the padding of the
    table, or its last column): their positions are zeroed and masked.
    """
    if seqs == list(range(seqs[0], seqs[0] + len(seqs))):
        table = block_tables[seqs[0] : seqs[0] + len(seqs)]
    else:
        table = block_tables[torch.tensor(seqs, device=block_tables.device)]
    if len(set(lo_blocks)) == 1:
        ids = table[:, lo_blocks[0] : lo_blocks[0] + cols]
    else:
        index = torch.tensor(lo_blocks, device=table.device)[:, None]
        index = (index + torch.arange(cols, device=table.device)).clamp_(max=table.shape[1] - 1)
        ids = table.gather(1, index)
    return ids.reshape(-1).to(torch.int64)


def _attend_bucket(
    bucket: _Bucket,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention output [n, num_heads, head_dim] of the bucket's sequences."""
    q = query if bucket.rows is None else query.index_select(0, bucket.rows)
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    packed = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    num_blocks = bucket.block_ids.numel()
    kbuf, vbuf = _workspace(k_cache, num_blocks)
    key = torch.index_select(k_cache, 0, bucket.block_ids, out=kbuf[:num_blocks])
    value = torch.index_select(v_cache, 0, bucket.block_ids, out=vbuf[:num_blocks])
    key, value = key.flatten(0, 1), value.flatten(0, 1)  # [n * cols * bs, kv_heads, D]
    if bucket.pad is not None:
        key.index_fill_(0, bucket.pad, 0)
        value.index_fill_(0, bucket.pad, 0)
    key = key.view(n, bucket.cols * block_size, num_kv_heads, head_dim)[:, bucket.keys]
    value = value.view(n, bucket.cols * block_size, num_kv_heads, head_dim)[:, bucket.keys]
    key, value = key.transpose(1, 2), value.transpose(1, 2)
    if softcap is not None:  # NOTE: SDPA has no soft-capping: the eager formula
        out = reference.softcapped_attention(packed, key, value, scale, softcap, bucket.mask)
        return out.reshape(n, num_heads, head_dim)
    # NOTE: 4-D inputs: CPU SDPA takes its flash kernel only for 4-D (3-D falls back to math)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=bucket.mask, scale=scale)
    return out.view(n, num_heads, head_dim)


def _run_plan(
    plan: DecodeBuckets,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode outputs written into `out` (allocated when None) at each bucket's rows."""
    if plan.num_rows != query.shape[0]:
        raise ValueError(f"query: plan is for {plan.num_rows} rows, got {query.shape[0]}")
    if len(plan.buckets) == 1 and plan.buckets[0].rows is None and out is None:
        return _attend_bucket(plan.buckets[0], query, k_cache, v_cache, scale, softcap)
    out = torch.empty_like(query) if out is None else out
    for bucket in plan.buckets:
        got = _attend_bucket(bucket, query, k_cache, v_cache, scale, softcap)
        if bucket.rows is None:
            out.copy_(got)
        else:
            out.index_copy_(0, bucket.rows, got)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    plan: DecodeBuckets | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence: query [num_seqs, num_heads, head_dim] -> same shape.

    `plan` (from `plan_decode` with these tables, lengths and window) saves re-planning per layer.
    `softcap`: the reference's (`reference.softcapped_attention`); None: plain SDPA.
    """
    if plan is None:
        ones = [1] * len(seq_lens)
        plan = plan_decode(block_tables, ones, seq_lens, k_cache, sliding_window)
    return _run_plan(plan, query, k_cache, v_cache, scale, None, softcap)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    plan: DecodeBuckets | None = None,
    *,
    native: native_plan.NativePlan | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Varlen causal attention (prefill, chunks, decode mixed): same contract as the reference.

    Sequences with several query tokens run one at a time (the reference's SDPA and masks, with
    the workspace gather); the single-token ones go through the batched decode `plan`, or
    through the native kernel when `native` (its plan) is given.
    """
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        end = start + q_len
        if q_len > 1:
            # NOTE: the first query (position seq_len - q_len) sees nothing before `first`
            first = max(0, seq_len - q_len + 1 - sliding_window) if sliding_window else 0
            key, value = _gather(k_cache, v_cache, block_tables[i], first, seq_len)
            out[start:end] = reference.sequence_attention(
                query[start:end], key, value, scale, sliding_window, softcap
            )
        start = end
    if native is not None:
        cpu_native.decode(native, query, k_cache, v_cache, scale, out, softcap)
    elif any(q_len == 1 for q_len in query_lens):
        if plan is None:
            plan = plan_decode(block_tables, query_lens, seq_lens, k_cache, sliding_window)
        _run_plan(plan, query, k_cache, v_cache, scale, out, softcap)
    return out
