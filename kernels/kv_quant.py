"""8-bit KV cache: writing K/V as codes with one scale per (block, KV head), and reading them back.

    codes   [num_blocks, block_size, num_kv_heads, head_dim]  int8 or float8_e4m3fn (a layer view)
    scales  [num_blocks, num_kv_heads]                         float32, value = code * scale

A block's scale is absmax / QMAX over the tokens written so far (QMAX 127 for int8, 448 for
e4m3). Decode appends one token at a time, so a new token larger than the block's range grows
the scale, and the block's earlier codes are re-encoded to it (round(code * old / new)): the
block always spans its largest value, and an earlier token loses at most half a step of the new
scale per growth. A block written from its first slot starts afresh (scale 0): a reused block's
old codes and scale are never read.

The result depends only on the order tokens were written in, not on the device or process:
prefill worker and decode worker write a prompt in the same chunks, so a transferred block is
the block an in-process run would hold (docs/quantization.md).

Attention reads a step's blocks through `dequantize_blocks` into a dense cache of the
activation dtype and runs the unquantized kernels over it: torch only, on any device.
"""

from __future__ import annotations

import torch

from pagedserve.kvstore.kv_cache import KV_QUANT_MAX


def encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> codes (saturating, round to nearest)."""
    qmax = KV_QUANT_MAX[dtype]
    if dtype == torch.int8:
        return values.round().clamp_(-qmax, qmax).to(torch.int8)
    return values.clamp(-qmax, qmax).to(dtype)


def write_kv(
    codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `values` [num_tokens, num_kv_heads, head_dim] into their slots (in place), growing
    the scales of the blocks they land in and re-encoding those blocks' earlier codes."""
    if values.shape[0] == 0:
        return
    block_size, num_heads = codes.shape[1], codes.shape[2]
    qmax = KV_QUANT_MAX[codes.dtype]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    touched, inverse = torch.unique(blocks, return_inverse=True)
    x = values.to(torch.float32)
    token_max = x.abs().amax(-1)  # [T, H]
    step_max = torch.zeros(len(touched), num_heads, dtype=torch.float32, device=x.device)
    step_max.scatter_reduce_(0, inverse[:, None].expand(-1, num_heads), token_max, "amax")
    fresh = torch.zeros(len(touched), dtype=torch.bool, device=x.device)
    fresh[inverse[offsets == 0]] = True
    old = torch.where(fresh[:, None], 0.0, scales[touched])
    new = torch.maximum(old, step_max / qmax)
    grown = (~fresh) & (new > old).any(-1)
    if bool(grown.any()):
        ids = touched[grown]
        ratio = old[grown] / new[grown]  # new > 0 wherever old > 0; 0 / x = 0 elsewhere
        ratio = torch.where(new[grown] > 0, ratio, 1.0)
        codes[ids] = encode(codes[ids].to(torch.float32) * ratio[:, None, :, None], codes.dtype)
    scales[touched] = new
    divisor = torch.where(new > 0, new, 1.0)[inverse]  # [T, H]
    codes[blocks, offsets] = encode(x / divisor[:, :, None], codes.dtype)


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The values of blocks `block_ids` [n] as a dense [n, block_size, num_kv_heads, head_dim]
    tensor of `dtype` (scaled in float32, then rounded once to `dtype`)."""
    picked = codes.index_select(0, block_ids)
    if picked.dtype != torch.int8:  # NOTE: torch promotes int8 * float32, not float8 * float32
        picked = picked.to(torch.float32)
    out = torch.empty(picked.shape, dtype=dtype, device=codes.device)
    return torch.mul(picked, scales.index_select(0, block_ids)[:, None, :, None], out=out)
