"""`linear` on CPU: for fp32, native kernels up to 16 rows, MKL on a packed weight above; for
bf16, oneDNN on a weight reordered once up to 16 rows (`onednn_packed`), `F.linear` above.

- up to NATIVE_MAX_TOKENS (16) rows, `csrc/linear_f32.c` (one row at a time reads the weight at
  the machine's bandwidth; every output the same sum whatever M: batch invariance);
- above, where torch has MKL, MKL's GEMM on the weight packed once (`mkl_packed`: `F.linear`'s
  kernels, bit for bit on one thread, at 1.2-1.6x its speed); else:
- up to GEMM_MAX_TOKENS, `csrc/gemm_f32.c`, a register-blocked GEMM: 512 rows where MKL runs
  its generic path (AMD: over SmolLM2's 120 fused decoder weights, 2 threads, AVX-512, GFLOP/s,
  32 rows 138 against the split `bmm`'s 102, 256 rows 165-167 against MKL's 146, 512 as MKL),
  64 rows on Intel, where MKL is near the FMA peak (Sapphire Rapids: 256 rows MKL 313 against
  the GEMM's 240; the GEMM is kept to 64 rows there for the decode stack, which it lets take
  decode batches whole);
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

from pagedserve.kernels import cpu_native, mkl_packed, onednn_packed

MAX_TOKENS = 256
"""From about this many input rows on `F.linear` is as fast."""
NATIVE_MAX_TOKENS = 16
"""Up to this many input rows the native kernel (csrc/linear_f32.c) is faster (docs/kernels.md)."""


def cpu_vendor() -> str:
    """The CPU's vendor id (`GenuineIntel`, `AuthenticAMD`), or "" where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def gemm_max_tokens(vendor: str) -> int:
    """Up to how many rows the native GEMM beats MKL on this vendor's CPUs (docs/kernels.md):
    MKL's sgemm takes its fast AVX-512 kernels on Intel only."""
    return 64 if vendor == "GenuineIntel" else 512


GEMM_MAX_TOKENS = gemm_max_tokens(cpu_vendor())
"""Above NATIVE_MAX_TOKENS and up to this many rows the native GEMM (csrc/gemm_f32.c) is faster
than the split `bmm` and MKL's `F.linear`; from here on MKL is as fast or faster."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [tokens, in] and weight [out, in]; contiguous output."""
    if x.dim() == 2 and x.shape[0] <= NATIVE_MAX_TOKENS:
        out = cpu_native.linear_f32(x, weight, bias)
        if out is None:
            out = onednn_packed.linear(x, weight, bias)
        if out is not None:
            return out
    else:
        out = mkl_packed.linear(x, weight, bias)
        if out is not None:
            return out
        if x.dim() == 2 and x.shape[0] <= GEMM_MAX_TOKENS:
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
