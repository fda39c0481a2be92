"""`cpu_linear.linear` is `F.linear`, bit for bit, on every path it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_linear import linear


@pytest.fixture(autouse=True)
def _two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (512, 256), (7, 64)], ids=str)  # 7: odd rows
def test_equals_f_linear_bit_for_bit(tokens, shape):
    g = torch.Generator().manual_seed(tokens)
    weight = torch.randn(shape, generator=g)
    x = torch.randn(tokens, shape[1], generator=g)
    out = linear(x, weight)
    assert out.is_contiguous() and out.shape == (tokens, shape[0])
    assert torch.equal(out, F.linear(x, weight))


def test_bias_and_other_dtypes_fall_back_to_f_linear():
    weight, bias, x = torch.randn(32, 16), torch.randn(32), torch.randn(2, 16)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    half = weight.to(torch.bfloat16), x.to(torch.bfloat16)
    assert torch.equal(linear(half[1], half[0]), F.linear(half[1], half[0]))
