"""Device dispatch: the one entry point the model calls for paged attention and cache writes.

Today every device runs `reference.py`; the Triton kernels (CUDA) and the fastest CPU path plug in
here without the model changing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import reference


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

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store this step's K/V [num_tokens, num_kv_heads, head_dim] into their slots."""
    reference.write_kv(k_cache, v_cache, key, value, meta.slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of this step's queries [num_tokens, num_heads, head_dim] over the paged cache."""
    if meta.is_decode_only:
        return reference.paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window
        )
    return reference.paged_attention(
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_lens,
        meta.seq_lens,
        scale,
        sliding_window,
    )


def copy_blocks(cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicate whole blocks (all layers) `src -> dst` in one pool."""
    reference.copy_blocks(cache, pairs)
