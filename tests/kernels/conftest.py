"""Kernel test fixtures: Triton runs interpreted on CPU, natively on CUDA; paged-cache factories.

NOTE: Triton decides interpreter vs compiler when a `@triton.jit` function is defined, from
TRITON_INTERPRET in the environment. So it is set here, at collection time, before any test
module imports the kernels; `triton_modules` re-imports them should something have imported them
earlier in this process without it.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# (atol, rtol) against kernels/reference.py; documented in docs/kernels.md.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture(scope="session")
def triton_modules() -> tuple[ModuleType, ModuleType]:
    """(triton_attention, triton_cache), interpreted unless on CUDA."""
    names = ("pagedserve.kernels.triton_attention", "pagedserve.kernels.triton_cache")
    mods = [importlib.import_module(name) for name in names]
    if not ON_CUDA and type(mods[0]._paged_attention_kernel).__name__ != "InterpretedFunction":
        mods = [importlib.reload(sys.modules[name]) for name in names]
    assert ON_CUDA or type(mods[0]._paged_attention_kernel).__name__ == "InterpretedFunction"
    return mods[0], mods[1]


@dataclass
class PagedCase:
    """One layer's strided K/V views of a block-major pool, filled with random K/V."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, shuffled ids, padded with 0
    query_lens: list[int]
    seq_lens: list[int]
    scale: float

    def query_start_loc(self) -> torch.Tensor:
        starts = torch.tensor([0, *self.query_lens]).cumsum(0)
        return starts.to(torch.int32).to(self.query.device)

    def seq_lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.query.device)


def build_case(
    *,
    seq_lens: list[int],
    query_lens: list[int] | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    shared_blocks: int = 0,
    seed: int = 0,
) -> PagedCase:
    """Sequences get random distinct blocks (shuffled, not in order) from a 2-layer pool; with
    `shared_blocks`, sequence 1 starts with sequence 0's first blocks (a shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    query_lens = query_lens or [1] * len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=g)
    pool = pool.to(dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    if shared_blocks:
        table[1, :shared_blocks] = table[0, :shared_blocks]
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    return PagedCase(
        query=query.to(dtype=dtype, device=device),
        pool=pool,
        k_cache=pool[:, 1, 0],
        v_cache=pool[:, 1, 1],
        block_tables=table.to(device),
        query_lens=query_lens,
        seq_lens=seq_lens,
        scale=head_dim**-0.5,
    )


@pytest.fixture
def make_case(device: torch.device):
    """`make_case(seq_lens=[...], **kwargs) -> PagedCase` on the test device."""

    def make(**kwargs: object) -> PagedCase:
        return build_case(device=device, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def make_cpu_case():
    """`make_cpu_case(seq_lens=[...], **kwargs) -> PagedCase` on the CPU, whatever the machine."""
    return build_case


@pytest.fixture
def tolerance():
    def get(dtype: torch.dtype) -> dict[str, float]:
        atol, rtol = TOLERANCES[dtype]
        return {"atol": atol, "rtol": rtol}

    return get


@pytest.fixture
def threads(request):
    """torch's thread count set to the test's `threads` parameter (indirect), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
