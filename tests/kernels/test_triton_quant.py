"""Triton weight-only quantized matmuls (kernels/triton_quant.py), interpreted on CPU: equal
to `F.linear` on the dequantized weight of the same `QuantizedLinear`, for int8 and int4
(groups of 32 and 64, Q4_1-style zeros), ragged M and N, and through `forward` on CUDA."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.quant import QuantizedLinear, WeightQuant

ON_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def triton_quant():
    """The module, interpreted unless on CUDA (TRITON_INTERPRET is set by conftest)."""
    name = "pagedserve.kernels.triton_quant"
    mod = importlib.import_module(name)
    if not ON_CUDA and type(mod._int4_kernel).__name__ != "InterpretedFunction":
        mod = importlib.reload(sys.modules[name])
    return mod


def layer(quant: WeightQuant, in_features: int, out_features: int, seed: int) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    q = QuantizedLinear(in_features, out_features, False, quant)
    weight = torch.randn(out_features, in_features, generator=g) * 0.1
    weight[:, : in_features // 2] += 0.05  # groups whose minimum is not -maximum (zeros != 0)
    q.load_weight(weight)
    return q


@pytest.mark.parametrize(
    "quant", [WeightQuant("int8"), WeightQuant("int4", 32), WeightQuant("int4", 64)],
    ids=lambda q: q.name,
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 5, 19])
def test_quantized_matmul_equals_linear_on_the_dequantized_weight(triton_quant, quant, m):
    device = "cuda" if ON_CUDA else "cpu"
    q = layer(quant, 128, 48, seed=m).to(device)  # 48: a partial N tile
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(1)).to(device)
    ops = q.cuda_operands()
    if quant.method == "int8":
        got = triton_quant.int8_linear(x, *ops)
    else:
        got = triton_quant.int4_linear(x, *ops, quant.group_size)
    torch.testing.assert_close(got, F.linear(x, q.dequantize()), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [32, 64])
def test_int8_with_a_scale_per_group_equals_linear_on_the_dequantized_weight(triton_quant, group):
    device = "cuda" if ON_CUDA else "cpu"
    g = torch.Generator().manual_seed(group)
    q = QuantizedLinear(128, 40, False, WeightQuant("int8"))
    q.load_int8_groups(torch.randint(-127, 128, (40, 128), generator=g, dtype=torch.int8),
                       torch.rand(40, 128 // group, generator=g) / 50)  # fmt: skip
    q = q.to(device)
    x = torch.randn(7, 128, generator=g).to(device)
    got = triton_quant.int8_linear(x, *q.cuda_operands())
    torch.testing.assert_close(got, F.linear(x, q.dequantize()), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one per 32k"):
        triton_quant.int8_linear(x, q.qweight, torch.ones(40, 3, device=device))


def test_nibbles_pack_even_codes_low(triton_quant):
    packed = triton_quant.pack_nibbles(torch.tensor([[1, 2, 15, 0]]))
    assert torch.equal(packed, torch.tensor([[0x21, 0x0F]], dtype=torch.uint8))


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_forward_on_cuda_takes_the_kernel_in_bf16():
    q = layer(WeightQuant("int4", 32), 256, 64, seed=3).to("cuda")
    x = torch.randn(7, 256, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), q.dequantize().float())
    torch.testing.assert_close(q(x).float(), want, atol=3e-2, rtol=3e-2)
