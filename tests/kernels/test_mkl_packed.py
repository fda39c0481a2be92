"""`mkl_packed`: fp32 weights packed once for MKL's GEMM (cblas_sgemm_pack / _compute from torch's
own libtorch_cpu), taken by `cpu_linear.linear` and the native decode stack from 17 rows on:
`F.linear`'s result bit for bit, each row the same whatever the batch, re-packed when the weight
changes, and refused (None) where it does not apply."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_linear, mkl_packed

pytestmark = pytest.mark.skipif(
    not mkl_packed.available(), reason="torch here has no MKL (or the native kernels are off)"
)

# SmolLM2's fused q/k/v, o, gate/up and down, and odd sizes (partial blocks of rows and k)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 100), (5, 17)]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_the_packed_product_is_f_linear_s(shape, rows, threads):
    """The same MKL kernels: bit for bit on one thread. On more, MKL may split F.linear's
    unpacked product otherwise (2 threads, [64 x 1536] @ [1536 x 576]: 9e-8 relative)."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(shape, generator=g), torch.randn(shape[0], generator=g)
    x = torch.randn(rows, shape[1], generator=g)
    for b in (None, bias):
        got = mkl_packed.linear(x, weight, b)
        assert got is not None and got.is_contiguous()
        if threads == 1:
            assert torch.equal(got, F.linear(x, weight, b))
        else:
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-6, atol=1e-5)
        assert torch.equal(cpu_linear.linear(x, weight, b), got)  # the path it takes from 17


def test_a_row_is_the_same_whatever_the_batch_and_its_place_in_it():
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(3072, 576, generator=g), torch.randn(300, 576, generator=g)
    whole = mkl_packed.linear(x, weight, None)
    for start, rows in ((0, 17), (5, 32), (40, 33), (100, 64), (3, 129), (44, 256)):
        got = mkl_packed.linear(x[start : start + rows], weight, None)
        assert torch.equal(got, whole[start : start + rows])


def test_strided_rows_and_a_row_slice_of_a_fused_weight():
    g = torch.Generator().manual_seed(2)
    fused, wide = torch.randn(96, 64, generator=g), torch.randn(20, 128, generator=g)
    x, part = wide[:, :64], fused[32:80]  # rows of x 128 apart; a weight that is a row slice
    assert torch.equal(mkl_packed.linear(x, part.contiguous(), None), F.linear(x, part))


def test_a_weight_changed_in_place_is_packed_again_and_a_dropped_one_frees_its_copy():
    weight, x = torch.randn(64, 32), torch.randn(20, 32)
    first = mkl_packed.packed(weight)
    assert first is not None and mkl_packed.packed(weight) is first  # packed once
    weight.mul_(2)
    assert mkl_packed.packed(weight) is not first
    assert torch.equal(mkl_packed.linear(x, weight, None), F.linear(x, weight))
    key = id(weight)
    del weight
    gc.collect()
    assert key not in mkl_packed.copies


def test_what_it_does_not_take_is_refused():
    weight = torch.randn(64, 32)
    assert mkl_packed.linear(torch.randn(16, 32), weight, None) is None  # the native kernels'
    assert mkl_packed.linear(torch.randn(20, 32, dtype=torch.bfloat16), weight, None) is None
    assert mkl_packed.packed(weight.to(torch.bfloat16)) is None
    assert mkl_packed.packed(torch.randn(32, 64).T) is None  # not contiguous
    assert mkl_packed.linear(torch.randn(20, 64)[:, ::2], weight, None) is None  # strided columns


def test_switched_off_the_unpacked_paths_are_taken(monkeypatch):
    monkeypatch.setattr(mkl_packed, "enabled", False)
    weight, x = torch.randn(64, 32), torch.randn(20, 32)
    assert not mkl_packed.available() and mkl_packed.linear(x, weight, None) is None
    assert cpu_linear.linear(x, weight).shape == (20, 64)
