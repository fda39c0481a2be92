"""`--quantization w8a8` on CPU: int8 codes per output channel times activations quantized to
int8 per row (token) at run time, as llama.cpp's Q8_0 matmuls quantize theirs.

    x [M, K] f32 ──quantize_rows_i8──► q [M, K] i8, s [M]        (csrc/quant_act.c)
    q @ codes^T  ──torch._int_mm──────► acc [M, N] i32           (oneDNN: AMX / VNNI)
    acc ──dequant_rows_i32──► (acc * s) * w_scale (+ bias) f32   (csrc/quant_act.c)

The int32 sums are exact, so the result is the same IEEE arithmetic as `w8a8_linear` in
kernels/reference.py, bit for bit, on any number of rows: a token's output never depends on its
batch. Where the native kernels are unavailable the reference runs instead (logged once).
"""

from __future__ import annotations

import logging

import torch

from pagedserve.kernels import cpu_native, reference

log = logging.getLogger(__name__)
_warned = False


def linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) -> [M, N] float32; codes int8 [N, K], scales float32
    [N] (and bias [N]) contiguous."""
    lib = cpu_native.library()
    if lib is None or x.stride(1) != 1:
        _warn_fallback(cpu_native.unavailable_reason() or "strided input")
        return reference.w8a8_linear(x, codes, scales, bias)
    rows, k = x.shape
    n = codes.shape[0]
    threads = torch.get_num_threads()
    q = torch.empty(rows, k, dtype=torch.int8)
    row_scales = torch.empty(rows, dtype=torch.float32)
    lib.quantize_rows_i8(x.data_ptr(), x.stride(0), q.data_ptr(), row_scales.data_ptr(), rows,
                         k, threads)  # fmt: skip
    acc = torch._int_mm(q, codes.t())
    out = torch.empty(rows, n, dtype=torch.float32)
    lib.dequant_rows_i32(
        acc.data_ptr(), row_scales.data_ptr(), scales.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, n, threads,
    )  # fmt: skip
    return out


def _warn_fallback(why: str) -> None:
    global _warned
    if not _warned:
        log.warning("w8a8 linears take the torch reference (slow): %s", why)
        _warned = True
