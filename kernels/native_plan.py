"""`NativePlan`: how the native CPU attention kernel (kernels/cpu_native.py) reads one step's
rows: which query rows, which block-table rows, and the positions each attends. Built once per
step and layout by `AttentionMetadata` (kernels/dispatch.py) and valid for every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class NativePlan:
    """The single-token sequences of one step, as the kernel reads them; valid for every layer."""

    query_rows: torch.Tensor  # [n] int64: each sequence's row of the query
    table_rows: torch.Tensor  # [n] int64: its row of the block tables
    firsts: torch.Tensor  # [n] int64: first attended position (a sliding window cuts it)
    ends: torch.Tensor  # [n] int64: its context length
    tables: torch.Tensor  # [num_seqs, max_blocks] int64, contiguous
    num_rows: int


def single_token_rows(query_lens: Sequence[int]) -> tuple[list[int], list[int], int]:
    """(query row of each single-token sequence, its index, the query's number of rows)."""
    rows, seqs, num_rows = [], [], 0
    for i, q_len in enumerate(query_lens):
        if q_len == 1:
            rows.append(num_rows)
            seqs.append(i)
        num_rows += q_len
    return rows, seqs, num_rows


def plan(
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    sliding_window: int | None,
) -> NativePlan:
    rows, seqs, num_rows = single_token_rows(query_lens)
    ends = [seq_lens[i] for i in seqs]
    firsts = [max(0, end - sliding_window) if sliding_window else 0 for end in ends]
    tables = block_tables.to(torch.int64).contiguous()
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return NativePlan(
        as_tensor(rows), as_tensor(seqs), as_tensor(firsts), as_tensor(ends), tables, num_rows
    )


def plan_every_row(
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    sliding_window: int | None,
) -> NativePlan:
    """Every query row as a sequence of its own, attending causally: row j of a chunk of q
    tokens ending at context length L attends up to position L - q + j (the decode stack's
    view of a step whose chunks are short, e.g. speculative verification)::

        sequence:  | context | t_0 t_1 ... t_(q-1) |      row of t_j: end = L - q + j + 1

    Each row gets its sequence's block table row (`tables` has one row per query row)."""
    owner = [i for i, q_len in enumerate(query_lens) for _ in range(q_len)]
    ends = [seq_lens[i] - q_len + j + 1 for i, q_len in enumerate(query_lens) for j in range(q_len)]
    firsts = [max(0, end - sliding_window) if sliding_window else 0 for end in ends]
    index = torch.tensor(owner, dtype=torch.int64, device=block_tables.device)
    tables = block_tables.to(torch.int64).index_select(0, index).contiguous()
    rows = torch.arange(len(owner), dtype=torch.int64)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return NativePlan(rows, rows, as_tensor(firsts), as_tensor(ends), tables, len(owner))
