"""The MLP activations of the checkpoints pagedserve runs, by their config.json `hidden_act` name.

Each is the function transformers' `ACT2FN` entry of the same name computes (the oracle's), so
outputs agree bit for bit. NOTE: importing `transformers.activations` costs a worker about 2 s of
start-up (it pulls in torch.distributed.tensor and sympy); this table costs nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation `name`; ValueError naming `hidden_act` for one pagedserve does not run."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"model: hidden_act {name!r} is not supported {tuple(ACTIVATIONS)}"
        ) from None
