"""Copies of weights in a GEMM library's own layout, kept beside the weights they copy.

`kernels/mkl_packed.py` (fp32, MKL) and `kernels/onednn_packed.py` (bf16, oneDNN) each hold
one `PackedCopies`. A weight is copied on its first product that wants the copy; the copy is
made again if the weight was changed in place since (its version counter), and goes when the
weight is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class PackedCopies:
    """weight -> its packed copy (keyed by id: tensors compare element-wise)."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def get(
        self, weight: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """`weight`'s copy, made by `pack(weight)` unless one of its current version is held."""
        held = self._held.get(id(weight))
        if held is not None and held[0]() is weight and held[1] == weight._version:
            return held[2]
        copy = pack(weight)
        if held is None or held[0]() is not weight:
            weakref.finalize(weight, self._held.pop, id(weight), None)
        self._held[id(weight)] = (weakref.ref(weight), weight._version, copy)
        return copy

    def weights(self) -> dict[int, torch.Tensor]:
        """id -> weight, for every live weight that has a copy (what the copies cost)."""
        return {key: w for key, (ref, _, _) in self._held.items() if (w := ref()) is not None}

    def __contains__(self, key: int) -> bool:
        """Whether a copy is held for the weight of id `key` (gone once it is collected)."""
        return key in self._held
