"""Weight-only quantization (model/quant.py): the packed int8 / int4 layers against their own
dequantized weights, the loader, the memory plan, and the oracle: pagedserve's quantized
engine against transformers' `generate` on the same dequantized weights, token for token."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.oracle import GREEDY, hf_dequantized, hf_greedy_on, make_prompts, run_engine

from pagedserve.kvstore.hashing import model_fingerprint
from pagedserve.model import quant as quant_module
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import QuantizedLinear, WeightQuant, quantize_int4, weight_quant
from pagedserve.model.runner import weight_bytes

MODES = [WeightQuant("int8"), WeightQuant("int4", 32), WeightQuant("int4", 64)]
HEAD_MODES = [WeightQuant("int8", lm_head=True), WeightQuant("int4", 32, lm_head=True)]


def mode_id(quant: WeightQuant | None) -> str:
    if quant is None:
        return "fp32"
    return quant.name + ("+head" if quant.lm_head else "")


def layer(quant: WeightQuant, out_features=48, in_features=128, seed=0, bias=False):
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * 0.05
    q = QuantizedLinear(in_features, out_features, bias, quant)
    q.load_weight(weight)
    if bias:
        q.bias.data.normal_()
    return q, weight


@pytest.mark.parametrize("quant", MODES, ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_the_packed_matmul_equals_its_dequantized_weight(quant, tokens):
    q, _ = layer(quant, bias=True)
    x = torch.randn(tokens, q.in_features)
    want = F.linear(x, q.dequantize(), q.bias)
    torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-5)
    # batched input shapes as a model passes them
    torch.testing.assert_close(q(x.view(1, tokens, -1)), want.view(1, tokens, -1))


@pytest.mark.parametrize("quant", MODES, ids=lambda q: q.name)
def test_bfloat16_activations(quant):
    q, _ = layer(quant)
    q.to(torch.bfloat16)
    assert q.scales.dtype == torch.bfloat16 and not q.qweight.is_floating_point()
    x = torch.randn(4, q.in_features, dtype=torch.bfloat16)
    got = q(x)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), q.dequantize().float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_int8_error_is_at_most_half_a_step_per_channel():
    q, weight = layer(WeightQuant("int8"))
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - weight).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64])
def test_int4_error_is_at_most_half_a_step_per_group(group):
    q, weight = layer(WeightQuant("int4", group))
    groups = weight.view(weight.shape[0], -1, group)
    low = groups.amin(-1)
    step = (groups.amax(-1) - low) / 15
    scale, zero = q.int4_scale_zero()  # float16 values: the step, and the minimum rounded down
    assert torch.equal(scale, scale.half().float())
    assert ((scale - step).abs() <= step * 2**-10 + low.abs() * 2**-10 / 15).all()
    assert torch.equal(zero - 8 * scale, (zero - 8 * scale).half().float())
    err = (q.dequantize() - weight).view_as(groups).abs()
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    # the codes use the whole range: every group has its minimum at 0 and its maximum at 15
    codes, _, _ = quantize_int4(weight, group)
    per_group = codes.view(weight.shape[0], -1, group)
    assert (per_group.amin(-1) == 0).all() and (per_group.amax(-1) == 15).all()


def test_gguf_style_codes_load_exactly():
    """A GGUF Q4_1 block is `d * q + m` (d and m float16): stored as scale d and zero m + 8 d,
    the layer's weight is exactly that (the path a GGUF loader takes without an fp32 copy),
    and on CPU it holds d and m as the file does, in float16."""
    torch.manual_seed(1)
    out_features, in_features, group = 16, 64, 32
    codes = torch.randint(0, 16, (out_features, in_features))
    d = (torch.rand(out_features, in_features // group) * 0.01).half().float()
    m = (-torch.rand(out_features, in_features // group) * 0.1).half().float()
    q = QuantizedLinear(in_features, out_features, False, WeightQuant("int4", group))
    q.load_int4(codes, d, m + 8 * d)
    assert q.scales.dtype == torch.float16 and q.scales.numel() == 2 * d.numel()
    want = codes.view(out_features, -1, group) * d[..., None] + m[..., None]
    torch.testing.assert_close(q.dequantize(), want.view(out_features, in_features))


@pytest.mark.parametrize("out_features", [64, 96, 32, 48, 16])
def test_int4_codes_read_back_exactly_from_the_layout_this_cpu_packs(out_features, monkeypatch):
    """ATen packs int4 in blocks of 64 output rows with AVX-512 and 32 with AVX2. Both the fast
    read-back (where the block fits) and the slow layout-agnostic one give back the codes."""
    assert quant_module._block_n() in (64, 32)  # every x86-64 CPU torch runs vectorized code on
    codes = torch.randint(0, 16, (out_features, 64), generator=torch.Generator().manual_seed(3))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(quant_module.unpack_int4(packed, out_features, 64), codes.int())
    monkeypatch.setattr(quant_module, "_block_n", lambda: None)  # another layout: the fallback
    assert torch.equal(quant_module.unpack_int4(packed, out_features, 64), codes.int())


def test_bad_settings_name_their_flag():
    with pytest.raises(ValueError, match="quantization:"):
        WeightQuant("int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        WeightQuant("int4", 48)
    with pytest.raises(ValueError, match="quantization_group_size"):
        QuantizedLinear(96, 8, False, WeightQuant("int4", 64))
    assert weight_quant(None) is None and weight_quant("none") is None
    with pytest.raises(ValueError, match="quantize_lm_head"):
        weight_quant(None, lm_head=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("quant", [None, *MODES, *HEAD_MODES], ids=mode_id)
def test_the_loader_quantizes_every_decoder_linear_and_the_plan_counts_its_bytes(
    make_tiny, quant, tied
):
    model_dir = make_tiny("llama", tie_word_embeddings=tied)
    config = load_model_config(model_dir, None, quant)
    model = load_model(config)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    head = quant is not None and quant.lm_head
    assert len(linears) == (0 if quant is None else 7 * config.num_layers + head)
    # NOTE: storages, not tensors: fused q/k/v and gate/up weights are slices of one buffer
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}  # fmt: skip
    assert weight_bytes(config) == sum(storages.values())
    if head:  # int8 per channel whatever the linears' mode; the embedding keeps its values
        assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.quant.method == "int8"
        assert model.model.embed_tokens.weight.dtype == torch.float32
    else:
        assert model.lm_head.weight.dtype == torch.float32


def test_int4_with_a_group_larger_than_a_layer_is_refused_at_load(tiny_llama):
    config = load_model_config(tiny_llama, None, WeightQuant("int4", 256))
    with pytest.raises(ValueError, match="quantization_group_size"):
        load_model(config)


def test_quantized_weights_are_part_of_the_block_hash_fingerprint():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    plain = model_fingerprint(config, dtype="float32")
    assert plain == model_fingerprint(config, dtype="float32", weights="")
    names = {"int8", "int4-g32", "int4-g128"}
    prints = {model_fingerprint(config, dtype="float32", weights=n) for n in names}
    assert len(prints) == 3 and plain not in prints


@pytest.mark.parametrize("quant", [*MODES[:2], HEAD_MODES[0]], ids=mode_id)
def test_quantized_greedy_equals_transformers_on_the_dequantized_weights(tiny_llama, quant):
    prompts = make_prompts((1, 7, 17, 33, 64))
    engine, seqs = run_engine(tiny_llama, prompts, quantization=quant)
    model = hf_dequantized(tiny_llama, quant)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy_on(model, prompt)
    assert len(seqs[0].output_token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("quant", MODES[:2], ids=lambda q: q.name)
def test_bfloat16_packed_kernels_agree_with_transformers_on_the_dequantized_weights(
    tiny_llama, quant
):
    """bf16 activations take ATen's packed kernels (their only fast path), which round
    differently from `F.linear` on a bf16 copy of the dequantized weight: not token-exact
    (measured: the tokens part after a few steps on the tiny model), so the first token's
    logits are compared, within bf16's precision, against transformers' bf16 model on the
    dequantized weights."""
    prompts = make_prompts((1, 7, 17, 33))
    engine, seqs = run_engine(
        tiny_llama, prompts, quantization=quant, dtype="bfloat16", record_logits=True
    )
    model = copy.deepcopy(hf_dequantized(tiny_llama, quant)).to(torch.bfloat16)
    for prompt, seq in zip(prompts, seqs, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0, -1].float()
        got = engine.logits[seq.request_id][0].float()
        # NOTE: the tiny random model's top logits tie within bf16's rounding; no argmax check
        assert (got - want).abs().max() <= 0.05 * want.abs().max(), len(prompt)
