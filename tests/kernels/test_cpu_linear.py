"""`cpu_linear.linear`: the native fp32 kernels (csrc/linear_f32.c for decode-sized batches,
csrc/gemm_f32.c up to 512 rows), within fp32 rounding of the exact product and each row the same
whatever the batch; `F.linear`, bit for bit, on every other path (larger batches, other dtypes,
no kernel)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_linear, cpu_native, mkl_packed
from pagedserve.kernels.cpu_linear import linear

BLOCKER = cpu_native.build_blocker()
needs_kernel = pytest.mark.skipif(BLOCKER is not None, reason=f"no native kernel: {BLOCKER}")

# every input width of the supported families' projections (hidden and intermediate sizes of
# SmolLM2 135M/360M/1.7B, Llama 3.2 1B/3B, Llama 3 8B, Mistral 7B, Qwen2 0.5B/1.5B/7B) and odd
# ones: the kernel's tail past the last whole vector
FAMILY_IN = [576, 960, 1536, 2048, 2560, 3072, 3584, 4096, 4864, 8192, 8960, 14336, 18944]
ODD_IN = [1, 7, 17, 33, 100]


@pytest.fixture(autouse=True)
def _two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def within_fp32_rounding(got: torch.Tensor, x, weight, bias=None) -> None:
    """|got - exact| <= k * eps32 * sum_k |x w| (+ the bias's own rounding): any order of fp32
    additions stays inside it."""
    exact = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    bound = weight.shape[1] * torch.finfo(torch.float32).eps * scale + 1e-30
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert ((got.double() - exact).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("k", FAMILY_IN + ODD_IN)
def test_native_is_within_fp32_rounding_for_every_family_width(k):
    g = torch.Generator().manual_seed(k)
    weight, x = torch.randn(37, k, generator=g), torch.randn(3, k, generator=g)
    for rows in (x[:1], x):  # the one-row path and the tiled one
        got = cpu_native.linear_f32(rows, weight, None)
        assert got is not None
        within_fp32_rounding(got, rows, weight)
        # and as close to torch's own product as any two fp32 orders are
        torch.testing.assert_close(got, F.linear(rows, weight), rtol=1e-4, atol=1e-4 * k**0.5)


@needs_kernel
@pytest.mark.parametrize("tokens", [2, 3, 5, 16])
@pytest.mark.parametrize("n", [1, 7, 9, 64, 1000])  # whole and partial tiles of rows
def test_a_row_is_the_same_whatever_the_batch(tokens, n):
    g = torch.Generator().manual_seed(tokens * n)
    weight, bias = torch.randn(n, 200, generator=g), torch.randn(n, generator=g)
    x = torch.randn(tokens, 200, generator=g)
    batch = linear(x, weight, bias)
    within_fp32_rounding(batch, x, weight, bias)
    for i in range(tokens):  # bit for bit: one sequence's logits never depend on its neighbours
        assert torch.equal(batch[i : i + 1], linear(x[i : i + 1], weight, bias))


@needs_kernel
def test_strided_inputs_and_row_slices_of_a_fused_weight():
    g = torch.Generator().manual_seed(5)
    fused, wide = torch.randn(96, 64, generator=g), torch.randn(4, 128, generator=g)
    x, part = wide[:, :64], fused[32:80]  # rows of x 128 apart; a weight that is a row slice
    within_fp32_rounding(linear(x, part), x, part)


@needs_kernel
@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_each_batch_size_takes_its_kernel_and_the_largest_f_linear(monkeypatch, vendor):
    monkeypatch.setattr(mkl_packed, "enabled", False)  # tests/kernels/test_mkl_packed.py
    bound = cpu_linear.gemm_max_tokens(vendor)
    monkeypatch.setattr(cpu_linear, "GEMM_MAX_TOKENS", bound)
    calls = []
    for name in ("linear_f32", "gemm_f32"):
        original = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _n=name, _f=original: calls.append(
            (_n, a[0].shape[0])) or _f(*a))  # fmt: skip
    weight = torch.randn(64, 32)
    for tokens in (cpu_linear.NATIVE_MAX_TOKENS, cpu_linear.NATIVE_MAX_TOKENS + 1,
                   cpu_linear.GEMM_MAX_TOKENS):  # fmt: skip
        linear(torch.randn(tokens, 32), weight)
    x = torch.randn(cpu_linear.GEMM_MAX_TOKENS + 1, 32)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert calls == [("linear_f32", 16), ("gemm_f32", 17), ("gemm_f32", bound)]


def test_mkl_keeps_the_batches_where_it_is_faster_on_intel():
    assert cpu_linear.gemm_max_tokens("GenuineIntel") == 64
    assert cpu_linear.gemm_max_tokens("AuthenticAMD") == cpu_linear.gemm_max_tokens("") == 512
    assert cpu_linear.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")


@needs_kernel
@pytest.mark.parametrize("k", FAMILY_IN[:8] + ODD_IN)
def test_the_gemm_is_within_fp32_rounding_for_every_family_width(k):
    g = torch.Generator().manual_seed(k)
    weight, bias = torch.randn(29, k, generator=g), torch.randn(29, generator=g)  # 29: 12 + 12 + 5
    x = torch.randn(45, k, generator=g)  # a whole panel of 32 rows and 13 in a half one
    got = cpu_native.gemm_f32(x, weight, bias)
    assert got is not None
    within_fp32_rounding(got, x, weight, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4 * k**0.5)


@needs_kernel
def test_a_gemm_row_is_the_same_whatever_the_batch_and_its_place_in_it():
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(50, 576, generator=g), torch.randn(100, 576, generator=g)
    whole = cpu_native.gemm_f32(x, weight, None)
    for part in (x[:17], x[:40], x[50:], x[90:]):  # half panels, whole ones, other offsets
        got = cpu_native.gemm_f32(part, weight, None)
        start = next(i for i in range(100) if torch.equal(x[i], part[0]))
        assert torch.equal(got, whole[start : start + len(part)])
    wide = torch.randn(40, 700, generator=g)  # rows of x 700 apart, a row slice of the weight
    within_fp32_rounding(cpu_native.gemm_f32(wide[:, :576], weight[10:], None), wide[:, :576],
                         weight[10:])  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (512, 256), (7, 64)], ids=str)  # 7: odd rows
def test_without_the_kernel_it_is_f_linear_bit_for_bit(tokens, shape, monkeypatch):
    monkeypatch.setattr(cpu_native, "enabled", False)
    monkeypatch.setattr(mkl_packed, "enabled", False)
    g = torch.Generator().manual_seed(tokens)
    weight = torch.randn(shape, generator=g)
    x = torch.randn(tokens, shape[1], generator=g)
    out = linear(x, weight)
    assert out.is_contiguous() and out.shape == (tokens, shape[0])
    assert torch.equal(out, F.linear(x, weight))


def test_other_dtypes_fall_back_to_f_linear():
    weight, x = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16)
    assert cpu_native.linear_f32(x, weight, None) is None
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert cpu_native.linear_f32(torch.randn(2, 16), torch.randn(16, 32).T, None) is None  # strides


def test_a_cpu_without_the_isa_takes_torch_and_says_so(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(cpu_native, "vector_width", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name, value in (("_tried", False), ("_lib", None), ("_why_not", None)):
        monkeypatch.setattr(cpu_native, name, value)
    weight, x = torch.randn(64, 32), torch.randn(1, 32)
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        out = linear(x, weight)
    assert torch.equal(out, F.linear(x, weight))
    assert "neither AVX-512 nor AVX2" in (cpu_native.unavailable_reason() or "")
    assert any("unavailable" in r.getMessage() for r in caplog.records)


def test_the_loader_reads_qkv_and_gate_up_as_one_weight_each(tiny_llama):
    from pagedserve.model.config import load_model_config
    from pagedserve.model.loader import load_model

    model = load_model(load_model_config(tiny_llama, None, None))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.fused and mlp.fused
    # the checkpoint's tensors live in the fused buffer: q, k, v (and gate, up) are its rows
    assert torch.equal(attn.fused_weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                     attn.v_proj.weight]))  # fmt: skip
    assert attn.q_proj.weight.data_ptr() == attn.fused_weight.data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.fused_weight.data_ptr()
    x = torch.randn(3, attn.q_proj.in_features)
    gate, up = F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)
    torch.testing.assert_close(mlp(x), mlp.down_proj(mlp.act_fn(gate) * up))
    assert "fused_weight" not in model.state_dict()  # a checkpoint saved from it is unchanged
