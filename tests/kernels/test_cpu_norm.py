"""The native fused residual add + RMSNorm (csrc/rms_norm.c) against transformers' arithmetic
(model/llama.py's torch path), and the model's norm through it."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native
from pagedserve.model.llama import RMSNorm

BLOCKER = cpu_native.build_blocker()
needs_kernel = pytest.mark.skipif(BLOCKER is not None, reason=f"no native kernel: {BLOCKER}")


def torch_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@pytest.mark.parametrize("n", [576, 896, 2048, 4096, 7, 33])  # family widths and odd tails
@pytest.mark.parametrize("rows", [1, 5])
def test_the_fused_add_and_norm_equal_torch_within_the_last_bit(n, rows):
    g = torch.Generator().manual_seed(n + rows)
    x, residual = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g) * 30
    weight = torch.rand(n, generator=g) + 0.5
    got = cpu_native.rms_norm(x, weight, 1e-5, residual)
    assert got is not None
    out, total = got
    assert torch.equal(total, x + residual)  # the add is torch's add, bit for bit
    # only the sum of squares is added in another order: the scale may move by an ulp or two
    torch.testing.assert_close(out, torch_norm(total, weight, 1e-5), rtol=3e-7, atol=0)
    alone, same = cpu_native.rms_norm(total, weight, 1e-5, None)  # type: ignore[misc]
    assert same is total and torch.equal(alone, out)


def test_the_module_takes_torch_where_the_kernel_cannot(monkeypatch):
    norm = RMSNorm(64, 1e-6)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    x, residual = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    native, total = norm.add_norm(x, residual)
    monkeypatch.setattr(cpu_native, "enabled", False)
    plain, plain_total = norm.add_norm(x, residual)
    assert torch.equal(plain_total, total)
    assert torch.equal(plain, torch_norm(x + residual, norm.weight, 1e-6))
    # NOTE: the sum of squares in another order moves the scale by up to ~3 ulp (3.3e-7 seen)
    torch.testing.assert_close(native, plain, rtol=6e-7, atol=0)
    bf16 = norm.to(torch.bfloat16)  # another dtype: torch's path, rounding as transformers
    monkeypatch.setattr(cpu_native, "enabled", True)
    assert cpu_native.rms_norm(x.bfloat16(), bf16.weight, 1e-6, None) is None
    assert bf16(x.bfloat16()).dtype == torch.bfloat16


@needs_kernel
def test_a_prompts_rows_split_between_threads_are_normed_as_one_row_alone():
    g = torch.Generator().manual_seed(9)
    x, residual = torch.randn(300, 576, generator=g), torch.randn(300, 576, generator=g)
    weight = torch.rand(576, generator=g) + 0.5
    out, total = cpu_native.rms_norm(x, weight, 1e-5, residual)  # type: ignore[misc]
    for i in (0, 150, 299):
        one = cpu_native.rms_norm(x[i : i + 1], weight, 1e-5, residual[i : i + 1])
        assert one is not None
        row, row_total = one
        assert torch.equal(out[i : i + 1], row) and torch.equal(total[i : i + 1], row_total)
