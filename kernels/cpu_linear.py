"""`linear` for fp32 on CPU: the weight's rows split into one batch entry per thread, one `bmm`.

Measured on this project's 2-core VM (torch 2.13 with MKL; `python -m
pagedserve.bench.kernels` does not cover it, the numbers come from a loop over 26 weights of
2816 x 1024, 300 MB, out of cache, 2 threads, best of 5):

    tokens                 1      4     16     64    256
    F.linear            19.2   34.2   40.3   74.9    228   ms
    this (bmm, split)   14.1   17.9   32.7   67.2    230   ms

For a decode-sized batch MKL keeps one GEMM on fewer cores than it has; ATen's `bmm` gives each
batch entry (a slice of the weight's rows) its own thread. Each slice is the same GEMM with the
same transposed weight operand, so the results are **bit-identical** to `F.linear` (checked in
tests/kernels/test_cpu_linear.py): logits and greedy tokens do not move. fp16/bf16 (oneDNN, not
MKL) and large batches (compute-bound, already parallel) keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native

MAX_TOKENS = 256
"""From about this many input rows on `F.linear` is as fast."""
NATIVE_MAX_TOKENS = 16
"""Up to this many input rows the native kernel (csrc/linear_f32.c) is faster (docs/kernels.md)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [tokens, in] and weight [out, in]; contiguous output."""
    if x.dim() == 2 and x.shape[0] <= NATIVE_MAX_TOKENS:
        out = cpu_native.linear_f32(x, weight, bias)
        if out is not None:
            return out
    parts = torch.get_num_threads()
    out_features, in_features = weight.shape
    if (
        parts < 2
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[0] > MAX_TOKENS
        or out_features % parts
        or bias is not None  # NOTE: addmm's fused bias rounds differently from a later add
    ):
        return F.linear(x, weight, bias)
    tokens = x.shape[0]
    # [parts, tokens, in] @ [parts, in, out/parts] -> [parts, tokens, out/parts]
    rows = weight.view(parts, out_features // parts, in_features).transpose(1, 2)
    out = torch.bmm(x.unsqueeze(0).expand(parts, tokens, in_features), rows)
    return out.permute(1, 0, 2).reshape(tokens, out_features)
