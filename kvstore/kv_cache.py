"""KV page tensors: the memory behind a `BlockPool`'s block ids.

Layout (docs/kv_layout.md): one tensor, block-major,

    [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

so that one block of every layer is a single contiguous run of bytes: swapping, copying and
transferring a block is one memcpy, and a shared-memory segment can be read block by block.

An 8-bit cache (`--kv-cache-dtype int8|fp8_e4m3`, docs/quantization.md) keeps the same codes
layout and puts one float32 scale per (layer, K/V, KV head) after them, in the same page:

    page = codes [num_layers, 2, block_size, num_kv_heads, head_dim]  int8 or float8_e4m3fn
         + scales [num_layers, 2, num_kv_heads]                      float32

Its tensor is then the raw pages, uint8 [num_blocks, bytes_per_block], and `layer()` /
`layer_scales()` are views into it: whatever moves whole blocks (swap, copy-on-write, shm,
gRPC) moves the scales with the codes and needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_quant import KV_QUANT_MAX

KV_DIM = 2  # K and V

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32
SCALE_LAYOUT = "float32[layer][kv][kv_head] after the codes"  # KvLayout.scale_layout


def kv_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` -> the element type stored in the pages: "auto" (or None) is the
    model's dtype. ValueError naming the flag otherwise."""
    if name in (None, "", "auto"):
        return model_dtype
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        choices = ["auto", *KV_CACHE_DTYPES]
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {choices}") from None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one pool's pages. Two pools can exchange blocks iff their specs are equal.

    `dtype` is the stored element type: the model's, or int8 / float8_e4m3fn for a scaled
    8-bit cache (`quantized`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.dtype in KV_QUANT_MAX

    @property
    def codes_shape(self) -> tuple[int, ...]:
        """One block's codes (or values): [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, KV_DIM, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def codes_bytes(self) -> int:
        elems = self.num_layers * KV_DIM * self.block_size * self.num_kv_heads * self.head_dim
        return elems * self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """One block's scales (0 unless quantized)."""
        if not self.quantized:
            return 0
        return self.num_layers * KV_DIM * self.num_kv_heads * SCALE_DTYPE.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.codes_bytes + self.scale_bytes

    @property
    def dtype_name(self) -> str:
        """The stored type as KvLayout.dtype names it: "float32", "int8", "float8_e4m3fn"."""
        return str(self.dtype).removeprefix("torch.")

    def storage_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of the pool tensor of `num_blocks` blocks (see `storage_dtype`)."""
        if self.quantized:
            return (num_blocks, self.bytes_per_block)
        return (num_blocks, *self.codes_shape)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many blocks fit in `memory_bytes` (at least 0)."""
        return max(0, memory_bytes // self.bytes_per_block)


class KVCache:
    """Owns the page tensor of `num_blocks` blocks; block ids index its first dimension.

    The tensor is never reallocated, so views returned by `layer()` stay valid for the life of
    the cache. Who may write which block is decided by the `BlockPool`, not here.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        tensor: torch.Tensor | None = None,
    ) -> None:
        shape = spec.storage_shape(num_blocks)
        if tensor is None:
            tensor = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
        elif tuple(tensor.shape) != shape or tensor.dtype != spec.storage_dtype:
            raise ValueError(
                f"tensor: expected {shape} {spec.storage_dtype}, got {tuple(tensor.shape)} "
                f"{tensor.dtype}"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.tensor = tensor
        self.codes = tensor
        self.scales: torch.Tensor | None = None
        if spec.quantized:
            # NOTE: views of the byte pages; splitting the contiguous last dim keeps them views
            self.codes = (
                tensor[:, : spec.codes_bytes].view(spec.dtype).view(num_blocks, *spec.codes_shape)
            )
            self.scales = (
                tensor[:, spec.codes_bytes :]
                .view(SCALE_DTYPE)
                .view(num_blocks, spec.num_layers, KV_DIM, spec.num_kv_heads)
            )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views (K, V) of one layer: [num_blocks, block_size, num_kv_heads, head_dim]
        (codes, for a quantized cache: see `layer_scales`)."""
        return self.codes[:, index, 0], self.codes[:, index, 1]

    def layer_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized cache's scale views (K, V) of one layer: [num_blocks, num_kv_heads]
        float32, value = code * scale; None for an unquantized cache."""
        if self.scales is None:
            return None
        return self.scales[:, index, 0], self.scales[:, index, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """The contiguous page of one block across all layers (a view)."""
        return self.tensor[block_id]
