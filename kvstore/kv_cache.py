"""KV page tensors: the memory behind a `BlockPool`'s block ids.

Layout (docs/kv_layout.md): one tensor, block-major,

    [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

so that one block of every layer is a single contiguous run of bytes: swapping, copying and
transferring a block is one memcpy, and a shared-memory segment can be read block by block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DIM = 2  # K and V


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one pool's pages. Two pools can exchange blocks iff their specs are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elems = self.num_layers * KV_DIM * self.block_size * self.num_kv_heads * self.head_dim
        return elems * torch.empty((), dtype=self.dtype).element_size()

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
        shape = (
            num_blocks,
            spec.num_layers,
            KV_DIM,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
        )
        if tensor is None:
            tensor = torch.zeros(shape, dtype=spec.dtype, device=device)
        elif tuple(tensor.shape) != shape or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor: expected {shape} {spec.dtype}, got {tuple(tensor.shape)}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.tensor = tensor

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views (K, V) of one layer: [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.tensor[:, index, 0], self.tensor[:, index, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """The contiguous page of one block across all layers (a view)."""
        return self.tensor[block_id]
