"""Triton weight-only quantized matmuls for CUDA: `y = x @ W.T` with W in int8 or int4 codes,
dequantized tile by tile inside the GEMM (model/quant.py's `QuantizedLinear` on a GPU).

    int8   codes int8 [N, K], scale [N]                      W[n, k] = q * scale[n]
           or scale [N, K / G] (GGUF Q8_0: G = 32)           W[n, k] = q * scale[n, k / G]
    int4   codes uint8 [N, K / 2] (k even: low nibble, odd: high), scale and zero [N, K / G]
                                                             W[n, k] = (q - 8) * scale + zero

x [M, K] in fp32, fp16 or bf16; the dots accumulate in fp32 and y is x's dtype. One program
computes a [BLOCK_M, BLOCK_N] tile of y; a K tile never straddles an int4 group (BLOCK_K
divides G). Checked against `F.linear` on the dequantized weight under TRITON_INTERPRET=1
(tests/kernels/test_triton_quant.py); no GPU was lent to this work, so its speed is unmeasured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_kernel(
    x_ptr, w_ptr, scale_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # GROUP 0: one scale per output channel, applied once at the end
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None],
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0)  # fmt: skip
        if GROUP > 0:
            scale = tl.load(scale_ptr + cols * stride_sn + k0 // GROUP, mask=cols < N, other=0.0)
            w_scaled = w.to(tl.float32) * scale[None, :]
            acc += tl.dot(x.to(tl.float32), w_scaled, input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
    if GROUP == 0:
        acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip


@triton.jit
def _int4_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)  # byte j of a K tile holds k = 2j and 2j + 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * half
        x_at = x_ptr + rows[:, None] * stride_xm + even[None, :]
        x_even = tl.load(x_at, mask=row_ok & (even[None, :] < K), other=0.0).to(tl.float32)
        x_odd = tl.load(x_at + 1, mask=row_ok & (even[None, :] + 1 < K), other=0.0).to(tl.float32)
        byte = k0 // 2 + half
        packed = tl.load(w_ptr + cols[None, :] * stride_wn + byte[:, None],
                         mask=col_ok & (byte[:, None] < K // 2), other=0).to(tl.int32)  # fmt: skip
        group = k0 // GROUP
        scale = tl.load(scale_ptr + cols * stride_sn + group, mask=cols < N, other=0.0)
        zero = tl.load(zero_ptr + cols * stride_sn + group, mask=cols < N, other=0.0)
        lo = ((packed & 15) - 8).to(tl.float32) * scale[None, :] + zero[None, :]
        hi = ((packed >> 4) - 8).to(tl.float32) * scale[None, :] + zero[None, :]
        acc += tl.dot(x_even, lo, input_precision=DOT_PRECISION)
        acc += tl.dot(x_odd, hi, input_precision=DOT_PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok & col_ok)  # fmt: skip


def _dot_precision(x: torch.Tensor) -> str:
    # NOTE: an fp32 dot on NVIDIA tensor cores defaults to TF32 (10-bit mantissa): fp32
    # activations get IEEE fp32 products, so the result is F.linear's on the dequantized weight.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (codes [N, K] int8 * scale).T -> [M, N] in x's dtype; scale [N] (per channel)
    or [N, K / group] with group a multiple of 32."""
    m, k = x.shape
    n = codes.shape[0]
    x, codes, scale = x.contiguous(), codes.contiguous(), scale.float().contiguous()
    group = k // scale.shape[1] if scale.dim() == 2 else 0
    if group % 32 or (group and group * scale.shape[1] != k):
        raise ValueError(f"scale: {tuple(scale.shape)} is not one per 32k input features of {k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_kernel[grid](
        x, codes, scale, y, m, n, k, x.stride(0), codes.stride(0), scale.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x),
    )  # fmt: skip
    return y


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] @ W.T with W from nibble-packed codes [N, K / 2] and (scale, zero) [N, K / group]
    -> [M, N] in x's dtype. `group` must be a multiple of 32."""
    if group % 32:
        raise ValueError(f"group: {group} is not a multiple of 32")
    m, k = x.shape
    n = packed.shape[0]
    x, packed = x.contiguous(), packed.contiguous()
    scale, zero = scale.float().contiguous(), zero.float().contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _block_m(m), 32, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_kernel[grid](
        x, packed, scale, zero, y, m, n, k,
        x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x),
    )  # fmt: skip
    return y


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] in 0..15 -> [N, K / 2] uint8, k even in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)
