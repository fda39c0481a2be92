"""`linear` for fp32 on CPU: native kernels for up to 512 rows, else MKL.

- up to NATIVE_MAX_TOKENS (16) rows, `csrc/linear_f32.c` (one row at a time reads the weight at
  the machine's bandwidth; every output the same sum whatever M: batch invariance);
- up to GEMM_MAX_TOKENS (512), `csrc/gemm_f32.c`, a register-blocked GEMM. Over SmolLM2's 120
  fused decoder weights (2 threads, AVX-512, GFLOP/s): 32 rows 138 against the split `bmm`'s
  102, 64 rows 135-156 against 114-122, 128 rows 157-163 against 142-149, 256 rows 165-167
  against 156-165 (MKL's `F.linear` 146), 512 rows as MKL (168-170);
- beyond, or where the native kernels are unavailable, the weight's rows split into one batch
  entry per thread and one `bmm` (for a decode-sized batch MKL keeps one GEMM on fewer cores
  than it has; ATen's `bmm` gives each slice its own thread; the same GEMM per slice, so
  **bit-identical** to `F.linear`, tests/kernels/test_cpu_linear.py), and from 256 rows, with a
  bias, or for fp16/bf16 (oneDNN), `F.linear`.

The native kernels sum in other orders than MKL (~1e-7 relative, within the fp32 rounding bound
the tests check); the greedy tokens of every oracle test are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_native

MAX_TOKENS = 256
"""From about this many input rows on `F.linear` is as fast."""
NATIVE_MAX_TOKENS = 16
"""Up to this many input rows the native kernel (csrc/linear_f32.c) is faster (docs/kernels.md)."""
GEMM_MAX_TOKENS = 512
"""Above NATIVE_MAX_TOKENS and up to this many rows the native GEMM (csrc/gemm_f32.c) is faster
than the split `bmm` and MKL's `F.linear`; from here on MKL is as fast (docs/kernels.md)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [tokens, in] and weight [out, in]; contiguous output."""
    if x.dim() == 2 and x.shape[0] <= NATIVE_MAX_TOKENS:
        out = cpu_native.linear_f32(x, weight, bias)
        if out is not None:
            return out
    elif x.dim() == 2 and x.shape[0] <= GEMM_MAX_TOKENS:
        out = cpu_native.gemm_f32(x, weight, bias)
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
