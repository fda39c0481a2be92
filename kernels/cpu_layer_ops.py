"""A decoder layer's element-wise steps for float32 on CPU, one native call each
(csrc/layer_ops.c), where torch takes five ops for rope and two for the activation.

On a prompt's thousands of rows those ops cost ~12 % of SmolLM2's prefill (the linears ~72 %):
each reads and writes [tokens, width] again, on one allocation of its own. The kernels read a
row once and split rows between torch's threads. Each function answers None (or False) where
the kernel cannot take its input: the caller then runs torch's ops.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native

MAX_HEAD_DIM = 512  # csrc/layer_ops.c's per-head scratch


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [T, H, D] in place by its rows' tables cos, sin [T, 1, D] (model/llama.py's
    `RopeTables`): `x * cos + rotate_half(x) * sin`, bit for bit as torch computes it. x's heads
    must lie packed in each row (any row stride). False, x unchanged, when the kernel cannot
    take it."""
    if x.dim() != 3:
        return False
    tokens, heads, dim = x.shape
    if not (
        tokens > 0
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(2) == 1
        and x.stride(1) == dim
        and dim % 2 == 0
        and dim <= MAX_HEAD_DIM
        and all(t.dtype == torch.float32 and t.shape == (tokens, 1, dim) and t.is_contiguous()
                for t in (cos, sin))
    ):  # fmt: skip
        return False
    lib = cpu_native.library()
    if lib is None:
        return False
    lib.rope_f32(x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), tokens,
                 torch.get_num_threads())  # fmt: skip
    return True


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up [T, I] for gate, up [T, I] (a fused gate/up linear's halves or two
    linears' outputs: any row strides). silu's exponential is libmvec's `expf`, torch's
    `F.silu` its own: they differ by a few ulp (the native decode stack computes it the same
    way). None when the kernel cannot take them."""
    if not (
        gate.dim() == 2
        and gate.shape == up.shape
        and gate.shape[0] > 0
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(1) == 1
                for t in (gate, up))
    ):  # fmt: skip
        return None
    lib = cpu_native.library()
    if lib is None:
        return None
    tokens, inter = gate.shape
    out = torch.empty(tokens, inter, dtype=torch.float32)
    lib.silu_mul_f32(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
                     tokens, inter, torch.get_num_threads())  # fmt: skip
    return out
