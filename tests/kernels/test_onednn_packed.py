"""`onednn_packed`: bf16 weights reordered once for oneDNN, taken by `cpu_linear.linear` up to 16
rows: `F.linear`'s result bit for bit (so bf16 outputs stay transformers'), reordered again when
the weight changes, and refused (None) where it does not apply."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_linear, onednn_packed

pytestmark = pytest.mark.skipif(
    not onednn_packed.available(), reason="no bf16 arithmetic here (or torch has no oneDNN)"
)

# SmolLM2's fused q/k/v, o, gate/up, down; a Qwen2-sized q/k/v with its bias; odd sizes
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1152, 896), (37, 100), (5, 17)]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_reordered_product_is_f_linear_s_bit_for_bit(shape, threads):
    g = torch.Generator().manual_seed(shape[0] + threads)
    weight = (torch.randn(shape, generator=g) * 0.05).bfloat16()
    bias = torch.randn(shape[0], generator=g).bfloat16()
    for rows in (1, 2, 3, 7, 16):
        x = torch.randn(rows, shape[1], generator=g).bfloat16()
        for b in (None, bias):
            got = onednn_packed.linear(x, weight, b)
            assert got is not None and got.dtype == torch.bfloat16 and got.is_contiguous()
            assert torch.equal(got, F.linear(x, weight, b)), (rows, b is not None)
            assert torch.equal(cpu_linear.linear(x, weight, b), got)  # the path it takes


def test_strided_rows_and_the_lm_head():
    g = torch.Generator().manual_seed(0)
    head = (torch.randn(49152, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(4, 1200, generator=g).bfloat16()[:, :576]
    assert not x.is_contiguous()
    assert torch.equal(onednn_packed.linear(x, head, None), F.linear(x, head))


def test_a_weight_changed_in_place_is_reordered_again_and_a_dropped_one_frees_its_copy():
    weight, x = torch.randn(64, 32).bfloat16(), torch.randn(3, 32).bfloat16()
    first = onednn_packed.linear(x, weight, None)
    assert id(weight) in onednn_packed.copies
    weight.mul_(2)
    again = onednn_packed.linear(x, weight, None)
    assert torch.equal(again, F.linear(x, weight)) and not torch.equal(again, first)
    key = id(weight)
    del weight
    gc.collect()
    assert key not in onednn_packed.copies


def test_what_it_does_not_take_is_refused(monkeypatch):
    weight = torch.randn(64, 32).bfloat16()
    assert onednn_packed.linear(torch.randn(17, 32).bfloat16(), weight, None) is None  # > 16
    assert onednn_packed.linear(torch.randn(2, 3, 32).bfloat16(), weight, None) is None  # 3-D
    assert onednn_packed.linear(torch.randn(2, 32), weight.float(), None) is None  # fp32
    assert onednn_packed.linear(torch.randn(2, 32).half(), weight.half(), None) is None
    monkeypatch.setattr(onednn_packed, "enabled", False)
    assert onednn_packed.linear(torch.randn(2, 32).bfloat16(), weight, None) is None
