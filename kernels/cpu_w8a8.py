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


VNNI_MAX_ROWS = 8
"""Up to this many rows the VNNI kernel (csrc/linear_w8a8.c) runs, above them `_int_mm`
(oneDNN: AMX tiles pay off on larger batches); both sum exactly, so they agree bit for bit."""


def has_vnni() -> bool:
    """Whether the native kernels were built with AVX-512 VNNI (the decode stack needs it)."""
    lib = cpu_native.library()
    return lib is not None and bool(lib.w8a8_vnni())


def code_sums(codes: torch.Tensor) -> torch.Tensor:
    """Each output channel's sum of codes (int32 [N]): what the VNNI kernel subtracts 128
    times, having shifted the activations' codes into unsigned bytes."""
    return codes.sum(dim=1, dtype=torch.int32)


def linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) -> [M, N] float32; codes int8 [N, K], scales float32
    [N] (and bias [N]; `sums`: `code_sums(codes)`, for the VNNI kernel) contiguous."""
    lib = cpu_native.library()
    if lib is None or x.stride(1) != 1:
        _warn_fallback(cpu_native.unavailable_reason() or "strided input")
        return reference.w8a8_linear(x, codes, scales, bias)
    rows, k = x.shape
    n = codes.shape[0]
    threads = torch.get_num_threads()
    out = torch.empty(rows, n, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    if sums is not None and rows <= VNNI_MAX_ROWS and lib.linear_w8a8_f32(
        x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), sums.data_ptr(),
        bias_ptr, out.data_ptr(), n, rows, n, k, threads,
    ):  # fmt: skip
        return out
    q = torch.empty(rows, k, dtype=torch.int8)
    row_scales = torch.empty(rows, dtype=torch.float32)
    lib.quantize_rows_i8(x.data_ptr(), x.stride(0), q.data_ptr(), row_scales.data_ptr(), rows,
                         k, threads)  # fmt: skip
    acc = torch._int_mm(q, codes.t())
    lib.dequant_rows_i32(acc.data_ptr(), row_scales.data_ptr(), scales.data_ptr(), bias_ptr,
                         out.data_ptr(), n, rows, n, threads)  # fmt: skip
    return out


def _warn_fallback(why: str) -> None:
    global _warned
    if not _warned:
        log.warning("w8a8 linears take the torch reference (slow): %s", why)
        _warned = True
