"""A float32 copy of a weight held in int4 codes (csrc/linear_i4g.c's layout), for batches of
rows large enough that one copy and a GEMM beat the int4 kernel (model/quant.py's NATIVE_ROWS).

The copy is `q * scale + low` per group, GGUF Q4_1's own form: `q * scale` is exact (a 4-bit
code times a float16), so the native copy and torch's below round once, the same way, and are
equal bit for bit. The native one takes ~0.3 ms where torch's ops took ~3 ms for SmolLM2's
fused gate/up weight (1.8 M weights); a prompt step makes one per linear.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native


def dequantize_int4(codes: torch.Tensor, pairs: torch.Tensor, in_features: int) -> torch.Tensor:
    """`cpu_native.pack_int4` codes [N, K / 2] and `pack_int4_scales` pairs [tiles, groups, 2,
    16] (float16) -> the weight [N, K] float32: natively where the kernel is built, else with
    torch's ops (the same values)."""
    rows, groups = codes.shape[0], pairs.shape[1]
    lib = cpu_native.library()
    if lib is not None and codes.is_contiguous() and pairs.is_contiguous():
        weight = torch.empty(rows, in_features, dtype=torch.float32)
        group = in_features // groups
        lib.dequant_i4g_f32(codes.data_ptr(), pairs.data_ptr(), weight.data_ptr(), rows,
                            in_features, group, torch.get_num_threads())  # fmt: skip
        return weight
    scale, low = _scale_low(pairs, rows)
    q = cpu_native.unpack_int4(codes).view(rows, groups, -1).float()
    return (q * scale[..., None] + low[..., None]).view(rows, in_features)


def _scale_low(pairs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' float16 scales and minimums `low`, as float32 [rows, groups]."""
    tiles, groups = pairs.shape[:2]
    both = pairs.float().permute(0, 3, 1, 2).reshape(tiles * 16, groups, 2)[:rows]
    return both[..., 0], both[..., 1]
