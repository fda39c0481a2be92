"""fp32 weights packed once for MKL's GEMM, for products of more than 16 rows on CPU.

`F.linear` calls MKL's `sgemm`, which copies the weight into its own blocked layout on every
call. MKL can keep that copy (`cblas_sgemm_pack` once, `cblas_sgemm_compute` per call), and
torch's own libtorch_cpu exports both on x86-64 builds with MKL: nothing is linked or installed.
The packed product is `F.linear`'s (the same kernels; a bias as addmm adds it: y starts as the
bias, beta = 1): bit for bit on one thread; on more, MKL may split the unpacked product
otherwise (seen once, 9e-8 relative). Each row is the same whatever the batch. And it is
faster: on one Sapphire Rapids core, SmolLM2's gate/up [3072 x 576] at 17 rows 120 GFLOP/s
against 75, at 64 rows 175 against 134, at 300 rows 179 against 153 (docs/kernels.md). So
decode batches above 16 rows (the native decode stack, through `Linear.packed`) and prompt
chunks (`cpu_linear.linear`) take it; up to 16 rows the native kernels keep the weight as it
lies (reading it once is the cost there).

The price is memory: one packed copy per fp32 weight (MKL reserves up to ~3x the weight's
bytes of address space, and touches about 1x). A decoder weight is packed when the native
decode stack is built (its first decode step), any weight on its first product of more than 16
rows (a prompt chunk; the LM head at 17 decoding sequences); it is packed again if it was
changed in place since (its version counter); the copy goes with the weight tensor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.packed_copies import PackedCopies

log = logging.getLogger(__name__)

enabled = True  # tests and benchmarks switch it off to compare against the unpacked paths
MIN_ROWS = 17
"""From this many rows on a product takes the packed weight (up to 16 the native kernels)."""

_ROW_MAJOR, _TRANS, _B_MATRIX = 101, 112, 162
_PACK_ROWS = 64  # NOTE: MKL's hint for the packed layout; the copy serves any number of rows

_lock = threading.Lock()
_mkl: ctypes.CDLL | None = None
_tried = False
copies = PackedCopies()


def _load() -> ctypes.CDLL | None:
    """libtorch_cpu with MKL's pack functions typed, after giving the native kernels its
    compute function; None where torch has no MKL or the kernels are unavailable."""
    global _mkl, _tried
    with _lock:
        if _tried:
            return _mkl
        _tried = True
        lib = cpu_native.library()
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        if lib is None or not torch.backends.mkl.is_available() or not os.path.isfile(path):
            return None
        try:
            mkl = ctypes.CDLL(path)
            size, pack, compute = (mkl.cblas_sgemm_pack_get_size, mkl.cblas_sgemm_pack,
                                   mkl.cblas_sgemm_compute)  # fmt: skip
        except (OSError, AttributeError) as err:
            log.info("MKL's packed GEMM unavailable (F.linear's path instead): %s", err)
            return None
        size.argtypes, size.restype = [ctypes.c_int] * 4, ctypes.c_size_t
        pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_void_p]  # fmt: skip
        pack.restype = None
        lib.set_sgemm_compute(ctypes.cast(compute, ctypes.c_void_p))
        _mkl = mkl
        return _mkl


def available() -> bool:
    """Whether products of MIN_ROWS rows and more take packed weights here."""
    return enabled and _load() is not None


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] (float32, CPU, contiguous) packed for MKL, cached with it; None when it
    cannot be (another dtype or layout, no MKL, `enabled` off)."""
    if not (
        enabled
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
    ):
        return None
    if _load() is None:
        return None
    return copies.get(weight, _pack)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """A new MKL-packed copy of `weight` (MKL loaded)."""
    assert _mkl is not None
    n, k = weight.shape
    out = torch.empty(-(-_mkl.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS, n, k) // 4))
    _mkl.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS, n, k, 1.0,
                          weight.data_ptr(), k, out.data_ptr())  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` on the packed weight for x [M, K] float32 (rows contiguous,
    M >= MIN_ROWS): a new [M, N]; None when it cannot take it (the caller goes on)."""
    if not (
        x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(1) == 1
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    ):
        return None
    w = packed(weight)
    lib = cpu_native.library()
    if w is None or lib is None:
        return None
    n, k = weight.shape
    y = torch.empty(x.shape[0], n)
    done = lib.linear_packed_f32(x.data_ptr(), x.stride(0), w.data_ptr(),
                                 None if bias is None else bias.data_ptr(), y.data_ptr(), n,
                                 x.shape[0], n, k)  # fmt: skip
    return y if done else None
