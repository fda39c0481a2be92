"""bf16 weights packed once for oneDNN, for products of up to 16 rows on CPU.

`F.linear` on bf16 CPU tensors calls oneDNN's matmul, which copies the weight into its own
blocked layout on every call; at a decode step's few rows that copy is most of the work. torch
exposes the same matmul on a weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`,
then `_linear_pointwise`), which is what its own compiler emits for frozen bf16 linears.

Up to MAX_ROWS rows the product on the reordered weight is `F.linear`'s **bit for bit**
(tests/kernels/test_onednn_packed.py checks 1-16 rows on the supported families' shapes, with
and without a bias, on one thread and two; on a Sapphire Rapids host the two first differ at 33
rows, where oneDNN changes its kernel), so bf16 outputs, and the greedy tokens of the bf16
oracle tests, are unchanged. On that host SmolLM2's [3072 x 576] weight at one row: 0.185 ->
0.112 ms; the model's whole bf16 decode step at one sequence: docs/kernels.md.

It runs only where the CPU computes bf16 in hardware (AVX512-BF16 or AMX: elsewhere torch
emulates bf16, and the reordered weight would only cost memory) and torch was built with
oneDNN. The price is memory: one reordered copy per bf16 weight that meets a product of up to
16 rows (every decoder linear and the LM head once the first decode step has run), kept with
the weight (`kernels/packed_copies.py`), counted by `model/runner.py:packed_copy_bytes`.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.packed_copies import PackedCopies

enabled = True  # tests and benchmarks switch it off to compare against `F.linear`
MAX_ROWS = 16
"""Up to this many rows a product takes the reordered weight (bit for bit `F.linear`'s)."""

copies = PackedCopies()
_usable: bool | None = None


def available() -> bool:
    """Whether bf16 products of up to MAX_ROWS rows take reordered weights here."""
    global _usable
    if _usable is None:
        ops = getattr(torch.ops, "mkldnn", None)
        _usable = (
            torch.backends.mkldnn.is_available()
            and cpu_native.has_bf16_arithmetic()
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
        )
    return enabled and _usable


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for bf16 x [M, K] (M <= MAX_ROWS) and weight [N, K] on CPU,
    on the weight reordered once: a new [M, N]; None when it does not take it (the caller goes
    on with `F.linear`)."""
    if not (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.bfloat16)
        and available()
    ):
        return None
    packed = copies.get(weight, _reorder)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
