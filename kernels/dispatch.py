"""Device dispatch: the one entry point the model calls for paged attention and cache ops.

Backends, chosen per call from the tensors' device unless a test or benchmark forces one with
`use_backend()` (nothing is read from the environment):

    cuda -> "triton"  (kernels/triton_attention.py, kernels/triton_cache.py)
    cpu  -> "cpu"     (kernels/cpu_native.py for fp32/bf16 decode rows where it builds, else
                       kernels/cpu_attention.py: the measured CPU winners, docs/kernels.md)
    "reference"       (kernels/reference.py, the oracle)

Forcing "triton" on a CPU tensor needs `TRITON_INTERPRET=1` in the environment before
`pagedserve.kernels.triton_*` is first imported (Triton reads it when the kernels are defined).
The Triton modules are imported lazily, on first use, for that reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from pagedserve.kernels import cpu_attention, cpu_native, kv_quant, native_plan, reference, swap

Backend = Literal["triton", "cpu", "reference"]
_BACKENDS = ("triton", "cpu", "reference")
_forced: Backend | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """How the flattened batch of one forward maps onto the paged cache.

    Built once per step by the model runner and shared by every layer.

        tokens:  | seq 0: q_len 0 tokens | seq 1: q_len 1 tokens | ... |
        seq i:   | cached context (seq_len - q_len) | this step's q_len tokens |
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence, including the new tokens
    # NOTE: device copies of the lengths for the Triton kernels, made once per step on demand.
    _device_lens: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # NOTE: the CPU decode plans, one per cache layout and window, shared by every layer.
    _cpu_plans: dict[tuple[object, ...], cpu_attention.DecodeBuckets] = field(
        default_factory=dict, repr=False
    )
    _native_plans: dict[tuple[int | None, bool], native_plan.NativePlan] = field(
        default_factory=dict, repr=False
    )
    # NOTE: an 8-bit cache's dense view of this step's blocks (kernels/kv_quant.py)
    _dense: tuple[int, torch.Tensor, AttentionMetadata] | None = field(default=None, repr=False)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    def device_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc [num_seqs + 1], seq_lens [num_seqs]) int32 on the tables' device."""
        if self._device_lens is None:
            starts = [0]
            for n in self.query_lens:
                starts.append(starts[-1] + n)
            both = torch.tensor(starts + self.seq_lens, dtype=torch.int32)
            both = both.to(self.block_tables.device, non_blocking=True)
            self._device_lens = (both[: len(starts)], both[len(starts) :])
        return self._device_lens

    def cpu_decode_plan(
        self, k_cache: torch.Tensor, sliding_window: int | None
    ) -> cpu_attention.DecodeBuckets:
        """The batched CPU plan of this step's single-token sequences (built on first use).

        The plan holds block ids read from `block_tables` then: the tables must not change
        during the step (the runner builds new metadata per step).
        """
        key = (tuple(k_cache.shape[1:]), k_cache.dtype, sliding_window)
        plan = self._cpu_plans.get(key)
        if plan is None:
            plan = cpu_attention.plan_decode(
                self.block_tables, self.query_lens, self.seq_lens, k_cache, sliding_window
            )
            self._cpu_plans[key] = plan
        return plan

    def cpu_native_plan(
        self, sliding_window: int | None, every_row: bool = False
    ) -> native_plan.NativePlan:
        """The native kernel's view of this step's single-token sequences, or with
        `every_row` of every query row as its own causal sequence (`native_plan.plan_every_row`,
        the decode stack's view of short chunks); built on first use."""
        plan = self._native_plans.get((sliding_window, every_row))
        if plan is None:
            build = native_plan.plan_every_row if every_row else native_plan.plan
            plan = build(self.block_tables, self.query_lens, self.seq_lens, sliding_window)
            self._native_plans[(sliding_window, every_row)] = plan
        return plan

    def dense_view(self, block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """(used, meta): the distinct block ids this step's sequences read [n], and metadata
        whose tables index `used` instead of the pool: attention over the `n` blocks
        dequantized in that order equals attention over the pool (built on first use)."""
        if self._dense is not None and self._dense[0] == block_size:
            return self._dense[1], self._dense[2]
        counts = torch.tensor([-(-n // block_size) for n in self.seq_lens])
        width = max(1, int(counts.max()))
        table = self.block_tables[:, :width]
        wanted = torch.arange(width)[None, :] < counts[:, None]
        wanted = wanted.to(table.device)
        used, inverse = torch.unique(table[wanted], return_inverse=True)
        tables = torch.zeros_like(table)
        tables[wanted] = inverse
        dense = AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=tables,
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
        )
        self._dense = (block_size, used, dense)
        return used, dense


def backend_for(device: torch.device) -> Backend:
    """The backend used for tensors on `device` (the forced one, if any)."""
    if _forced is not None:
        return _forced
    return "triton" if device.type == "cuda" else "cpu"


@contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Force one backend for every call inside the block (tests, benchmarks)."""
    global _forced
    if name not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {name!r}")
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def prepare(device: torch.device, dtype: torch.dtype) -> None:
    """Build what attention on `device` in `dtype` will use now, at start-up, not in the first
    step: the native CPU kernel for fp32 (compiled once per host, ~1 s; a log line if it cannot
    be built, and the torch path then)."""
    if backend_for(device) == "cpu" and dtype == torch.float32:
        cpu_native.unavailable_reason()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store this step's K/V [num_tokens, num_kv_heads, head_dim] into their slots; with
    `scales` (an 8-bit cache's K and V scale views) as codes, on any device (kv_quant)."""
    if scales is not None:
        # NOTE: a decode-only step writes each sequence's own last block (never shared: a
        # shared block is copied before it is written), one token each
        single = meta.is_decode_only
        kv_quant.write_kv(k_cache, scales[0], key, meta.slot_mapping, one_per_block=single)
        kv_quant.write_kv(v_cache, scales[1], value, meta.slot_mapping, one_per_block=single)
        return
    if backend_for(k_cache.device) == "triton":
        from pagedserve.kernels import triton_cache

        triton_cache.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    else:
        reference.write_kv(k_cache, v_cache, key, value, meta.slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of this step's queries [num_tokens, num_heads, head_dim] over the paged cache.

    `scale` multiplies q . k (any value: Gemma's query_pre_attn_scalar ** -0.5 as well as
    head_dim ** -0.5). `softcap` (Gemma 2's attn_logit_softcapping, > 0) caps the scaled
    logits to softcap * tanh(logit / softcap) before the causal/window mask and the softmax,
    on every backend; None: no capping (every result as without the argument).

    An 8-bit cache (`scales` given) is read in place by the native CPU kernel for fp32 decode
    steps, and otherwise through a dense copy of the step's blocks in the query's dtype, by the
    same kernels (`AttentionMetadata.dense_view`)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected None or a positive number, got {softcap!r}")
    if scales is not None:
        if (
            meta.is_decode_only
            and backend_for(query.device) == "cpu"
            and cpu_native.supports_quantized(query, k_cache, scales[0])
        ):
            out = torch.empty_like(query)
            native = meta.cpu_native_plan(sliding_window)
            return cpu_native.decode_quantized(
                native, query, k_cache, v_cache, scales, scale, out, softcap
            )
        used, dense = meta.dense_view(k_cache.shape[1])
        key = kv_quant.dequantize_blocks(k_cache, scales[0], used, query.dtype)
        value = kv_quant.dequantize_blocks(v_cache, scales[1], used, query.dtype)
        return paged_attention(query, key, value, dense, scale, sliding_window, softcap=softcap)
    backend = backend_for(query.device)
    if backend == "triton":
        return _triton_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    if backend == "cpu":
        return _cpu_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    return reference.paged_attention(
        query, k_cache, v_cache, meta.block_tables, meta.query_lens, meta.seq_lens, scale,
        sliding_window, softcap,
    )  # fmt: skip


def _cpu_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    if cpu_native.supports(query, k_cache, softcap):
        native = meta.cpu_native_plan(sliding_window)
        if meta.is_decode_only:
            out = torch.empty_like(query)
            return cpu_native.decode(native, query, k_cache, v_cache, scale, out, softcap)
        return cpu_attention.paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.query_lens, meta.seq_lens, scale,
            sliding_window, native=native, softcap=softcap,
        )  # fmt: skip
    plan = meta.cpu_decode_plan(k_cache, sliding_window)
    if meta.is_decode_only:
        return cpu_attention.paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, plan,
            softcap=softcap,
        )  # fmt: skip
    return cpu_attention.paged_attention(
        query, k_cache, v_cache, meta.block_tables, meta.query_lens, meta.seq_lens, scale,
        sliding_window, plan, softcap=softcap,
    )  # fmt: skip


def _triton_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    from pagedserve.kernels import triton_attention

    query_start_loc, seq_lens = meta.device_lens()
    max_query_len = max(meta.query_lens)
    num_splits = 1
    if max_query_len == 1:
        num_splits = triton_attention.default_num_splits(
            len(meta.seq_lens), k_cache.shape[2], max(meta.seq_lens), query.device
        )
    return triton_attention.paged_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        query_start_loc,
        seq_lens,
        max_query_len,
        scale,
        sliding_window,
        num_splits,
        softcap,
    )


def copy_blocks(cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicate whole blocks (all layers) `src -> dst` in one pool."""
    if backend_for(cache.device) == "triton":
        from pagedserve.kernels import triton_cache

        triton_cache.copy_blocks(cache, pairs)
    else:
        reference.copy_blocks(cache, pairs)


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]
) -> None:
    """Copy blocks between two pools of one spec (device <-> host swap space): `dst[d] = src[s]`.

    Device -> pinned host (and back) is asynchronous on the current CUDA stream: synchronise
    (an event) before reading the destination or reusing the source blocks.
    """
    swap.swap_blocks(src_cache, dst_cache, pairs)
