"""`--quantization w8a8`: int8 weights per channel, activations quantized per row at run time,
int8 products on oneDNN's `_int_mm` (AMX / VNNI) between two native passes (csrc/quant_act.c).

The kernel's result is the torch reference's (kernels/reference.py) bit for bit, on any number
of rows; the engine's greedy tokens are those of transformers computing the same arithmetic.
"""

from __future__ import annotations

import logging

import pytest
import torch
from support.oracle import hf_greedy_on, make_prompts, run_engine
from transformers import AutoModelForCausalLM

from pagedserve.kernels import cpu_native, cpu_w8a8, reference
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import QuantizedLinear, WeightQuant, quantize_int8

needs_native = pytest.mark.skipif(
    cpu_native.unavailable_reason() is not None, reason="native CPU kernels unavailable"
)
W8A8 = WeightQuant("w8a8")
HAS_VNNI = cpu_w8a8.has_vnni()  # NOTE: where the CPU lacks it, the stack declines w8a8 layers


def operands(n, k, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    codes, scales = quantize_int8(torch.randn(n, k, generator=gen))
    return codes, scales, torch.randn(n, generator=gen) if bias else None


@needs_native
@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (3, 576, 1536), (17, 1536, 576), (130, 96, 77),
                                      (5, 100, 49)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "vnni",
    [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_VNNI, reason="no AVX-512 VNNI"))],
    ids=["int_mm", "vnni"],
)
def test_the_kernels_equal_the_reference_bit_for_bit(rows, k, n, bias, vnni, monkeypatch):
    """`_int_mm` and the VNNI kernel (on every row count here, as the decode stack calls it;
    k not a multiple of its 64-byte vectors included)."""
    monkeypatch.setattr(cpu_w8a8, "VNNI_MAX_ROWS", 1000)
    codes, scales, b = operands(n, k, bias=bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :5] = 0.0  # exact zeros and a tie-free row of zeros below
    if rows > 2:
        x[2] = 0.0
    sums = cpu_w8a8.code_sums(codes) if vnni else None
    got = cpu_w8a8.linear(x, codes, scales, b, sums)
    assert torch.equal(got, reference.w8a8_linear(x, codes, scales, b))


def test_rows_are_rounded_half_to_even_and_scaled_by_their_own_maximum():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    codes, scales = reference.quantize_rows_int8(x)
    assert codes[0].tolist() == [127, 0, 2, -2, -127]
    assert codes[1].tolist() == [0] * 5 and scales[0].item() == 1.0


@needs_native
def test_a_rows_result_does_not_depend_on_its_batch():
    codes, scales, b = operands(200, 192, bias=True)
    x = torch.randn(33, 192, generator=torch.Generator().manual_seed(2))
    whole = cpu_w8a8.linear(x, codes, scales, b)
    for i in (0, 16, 32):
        assert torch.equal(
            cpu_w8a8.linear(x[i : i + 1].contiguous(), codes, scales, b)[0], whole[i]
        )


def test_the_error_is_that_of_int8_activations():
    """Within a few quantization steps of the weight-only product (so a test comparing the two
    can tell them apart: they differ)."""
    codes, scales, _ = operands(64, 256)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    exact = x @ (codes.float() * scales[:, None]).t()
    got = reference.w8a8_linear(x, codes, scales)
    err = (got - exact).abs().max().item()
    assert 0 < err < 0.02 * exact.abs().max().item()


def test_without_native_kernels_the_reference_runs_and_says_so(monkeypatch, caplog):
    codes, scales, _ = operands(24, 64)
    x = torch.randn(3, 64)
    monkeypatch.setattr(cpu_native, "enabled", False)
    monkeypatch.setattr(cpu_w8a8, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels.cpu_w8a8"):
        got = cpu_w8a8.linear(x, codes, scales, None)
    assert torch.equal(got, reference.w8a8_linear(x, codes, scales))
    assert "torch reference" in caplog.text


class _W8A8Linear(torch.nn.Module):
    """transformers' Linear replaced by the same arithmetic, over the engine's codes."""

    def __init__(self, q: QuantizedLinear):
        super().__init__()
        self.q = q

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        out = reference.w8a8_linear(rows, self.q.qweight, self.q.scales, self.q.bias)
        return out.view(*x.shape[:-1], -1)


def hf_w8a8(model_dir, lm_head: bool):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = QuantizedLinear(child.in_features, child.out_features, False, W8A8)
                    q.load_weight(child.weight.data)
                    setattr(parent, name, _W8A8Linear(q))
    if lm_head:
        head = model.lm_head
        q = QuantizedLinear(head.in_features, head.out_features, False, W8A8)
        q.load_weight(head.weight.data)
        model.lm_head = _W8A8Linear(q)
    return model


@needs_native
@pytest.mark.parametrize("lm_head", [False, True], ids=["head-fp32", "head-w8a8"])
def test_greedy_equals_transformers_computing_int8_activations(tiny_llama, lm_head):
    quant = WeightQuant("w8a8", lm_head=lm_head)
    prompts = make_prompts((1, 7, 17, 33, 64))
    engine, seqs = run_engine(tiny_llama, prompts, quantization=quant)
    model = hf_w8a8(tiny_llama, lm_head)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy_on(model, prompt)


@needs_native
def test_the_native_decode_stack_takes_w8a8_layers_with_vnni(tiny_llama):
    engine, _ = run_engine(tiny_llama, make_prompts((5,)), quantization=W8A8)
    model = engine.runner.model
    stack = model._native_stack(engine.runner.kv_cache)
    assert (stack is not None) == cpu_w8a8.has_vnni()
    assert all(m.w8a8 for m in model.modules() if isinstance(m, QuantizedLinear))


def test_w8a8_is_refused_outside_float32_on_cpu(tiny_llama):
    config = load_model_config(tiny_llama, "bfloat16", W8A8)
    with pytest.raises(ValueError, match="quantization: w8a8 runs on CPU with float32"):
        load_model(config, "cpu")


def test_w8a8_blocks_never_match_weight_only_int8_blocks():
    """Their KV differs, so their block hashes must: the name is part of the fingerprint."""
    from pagedserve.cli_options import quantization_name
    from pagedserve.kvstore.hashing import model_fingerprint

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    names = [quantization_name(m) for m in ("int8", "w8a8")]
    assert names == ["int8", "w8a8"]
    prints = {model_fingerprint(config, dtype="float32", weights=n) for n in names}
    assert len(prints) == 2
