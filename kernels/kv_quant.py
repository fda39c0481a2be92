"""8-bit KV cache: writing K/V as codes with one scale per (block, KV head), and reading them back.

    codes   [num_blocks, block_size, num_kv_heads, head_dim]  int8 or float8_e4m3fn (a layer view)
    scales  [num_blocks, num_kv_heads]                         float32, value = code * scale

A block's scale is absmax / QMAX over the tokens written so far (QMAX 127 for int8, 448 for
e4m3). Tokens are appended one at a time, so a new token larger than the block's range grows
the scale, and the block's earlier codes are re-encoded to it (round(code * old / new)): the
block always spans its largest value, and an earlier token loses at most half a step of the new
scale per growth. A block written from its first slot starts afresh (scale 0): a reused block's
old codes and scale are never read.

Because every write appends in token order, a block's codes depend on its tokens' K/V alone,
not on how the work was cut into steps: prefill chunks, decode steps, recompute after
preemption, another worker's prefill (docs/quantization.md).

Reading (kernels/dispatch.py): fp32 decode steps on CPU take the native kernel, which reads
the codes in place; everything else reads the step's blocks through `dequantize_blocks` into a
dense cache of the activation dtype and runs the unquantized kernels over it, on any device.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_native

# 8-bit KV element types -> the largest code magnitude a scale maps absmax to (kvstore's
# `KVCacheSpec.quantized` reads it too: the kernels own the code range)
KV_QUANT_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> codes (saturating, round to nearest)."""
    qmax = KV_QUANT_MAX[dtype]
    if dtype == torch.int8:
        return values.round().clamp_(-qmax, qmax).to(torch.int8)
    return values.clamp(-qmax, qmax).to(dtype)


def write_kv(
    codes: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    one_per_block: bool = False,
) -> None:
    """Store `values` [num_tokens, num_kv_heads, head_dim] into their slots (in place), as if
    each block's new tokens were appended one at a time in slot order: a token that is larger
    than its block's range grows the scale and re-encodes the block's earlier codes.

    Appending in order makes a block's codes a function of its tokens alone: a prompt prefilled
    in one chunk or in many, a decode step's single token, a recomputed sequence and a prefix
    cache hit all leave the same codes. Round k appends the k-th new token of every block at
    once, so a decode step (one token per block) is one round and a prefill at most block_size.
    `one_per_block` says the caller knows no two tokens share a block (a decode-only step: each
    sequence writes its own last block), which skips finding the rounds.
    """
    if values.shape[0] == 0:
        return
    block_size = codes.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    if one_per_block and cpu_native.append_int8(codes, scales, values, blocks, offsets):
        return
    x = values.to(torch.float32)
    token_max = x.abs().amax(-1)  # [T, H]
    if one_per_block:
        _append(codes, scales, x, token_max, blocks, offsets)
        return
    touched, inverse = torch.unique(blocks, return_inverse=True)
    first = torch.full((len(touched),), block_size, dtype=offsets.dtype, device=x.device)
    first.scatter_reduce_(0, inverse, offsets, "amin")
    rank = offsets - first[inverse]  # the token's turn among its block's new tokens
    for k in range(int(rank.max()) + 1):
        now = (rank == k).nonzero().squeeze(1)
        _append(codes, scales, x[now], token_max[now], blocks[now], offsets[now])


def _append(
    codes: torch.Tensor,
    scales: torch.Tensor,
    x: torch.Tensor,
    token_max: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """One round: a token (x [n, H, D], its absmax per head [n, H]) for each of n distinct
    blocks, at its slot `offsets` in block `blocks`."""
    qmax = KV_QUANT_MAX[codes.dtype]
    old = torch.where(offsets[:, None] == 0, 0.0, scales[blocks])  # the first slot starts afresh
    new = torch.maximum(old, token_max / qmax)
    grown = (offsets > 0) & (new > old).any(-1)
    if bool(grown.any()):
        ratio = torch.where(new[grown] > 0, old[grown] / new[grown], 1.0)
        ids = blocks[grown]
        codes[ids] = encode(codes[ids].to(torch.float32) * ratio[:, None, :, None], codes.dtype)
    scales[blocks] = new
    divisor = torch.where(new > 0, new, 1.0)[:, :, None]
    codes[blocks, offsets] = encode(x / divisor, codes.dtype)


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
