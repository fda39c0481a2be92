"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text (`Gemma3ForCausalLM`): Gemma's layer (four
(1 + weight) RMSNorms, GeGLU), embeddings times sqrt(hidden), query_pre_attn_scalar's attention
scale, sliding layers beside full ones; Gemma 2's soft-capped attention scores and logits;
Gemma 3's per-head q/k norms and a rope per layer type (model/gemma.py). The tiny models
(tests/conftest.py) window 12 tokens on layer 0: the prompts here are shorter than, as long as
and longer than that. Here: exactness against transformers (fp32 tokens and logits, bf16 tokens,
continuous batching, chunked prefill with swap preemption, 2 tensor-parallel ranks, quantized
weights, one cluster), the configs' defaults, and what is refused at load."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from support.oracle import (
    GREEDY,
    assert_swap_keeps_transformers_tokens,
    hf_dequantized,
    hf_greedy,
    hf_greedy_on,
    hf_model,
    make_engine,
    make_prompts,
    run_engine,
)

from pagedserve.model.config import load_model_config, rope_frequencies
from pagedserve.model.quant import WeightQuant

GEMMA = ["gemma2", "gemma3"]
# NOTE: one set of prompts for every float32 test, so transformers runs each once a session:
# shorter than, as long as and longer than the tiny models' window of 12
PROMPTS = make_prompts((1, 12, 13, 40, 150), seed=11)
# NOTE: the tiny models' embeddings are untied (pagedserve/tiny_model.py); real Gemma ties them:
# the tied variant runs two of the prompts (each past the window), to keep the suite short
VARIANTS = {
    "gemma2": ("gemma2", {}, PROMPTS), "gemma3": ("gemma3", {}, PROMPTS),
    "gemma3-tied": ("gemma3", {"tie_word_embeddings": True}, PROMPTS[2:4]),
}  # fmt: skip


def _check_tokens_and_logits(model_dir, engine, prompts, seqs) -> None:
    for prompt, seq in zip(prompts, seqs, strict=True):
        want_tokens, want_logits = hf_greedy(model_dir, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        got_logits = torch.stack(engine.logits[seq.request_id])
        max_err = (got_logits - want_logits).abs().max().item()
        assert max_err < 1e-4, f"prompt of {len(prompt)}: max |logit diff| {max_err:.2e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_tokens_and_logits_are_transformers_with_requests_joining_mid_decode(
    make_tiny, variant
):
    """Half the prompts start; the others join three decode steps later (continuous batching);
    blocks of 8 tokens, so the window of 12 spans block boundaries."""
    arch, kwargs, prompts = VARIANTS[variant]
    model_dir = make_tiny(arch, **kwargs)
    engine = make_engine(model_dir, block_size=8, num_blocks=160)
    engine.record_logits = True
    half = len(prompts) // 2
    seqs = [engine.add_request(p, GREEDY) for p in prompts[:half]]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(p, GREEDY) for p in prompts[half:]]
    while engine.has_unfinished:
        engine.step()
    engine.check_integrity()
    _check_tokens_and_logits(model_dir, engine, prompts, seqs)


@pytest.mark.parametrize("arch", GEMMA)
def test_bf16_greedy_tokens_are_transformers(make_tiny, arch):
    """Exact equality: the model mirrors transformers' op order and casts in bf16 too (the
    (1 + weight) norm in float32, the embedding multiplier rounded to bf16), so no near-tie
    allowance is needed for these prompts."""
    model_dir = make_tiny(arch)
    prompts = [PROMPTS[2], PROMPTS[4]]
    engine = make_engine(model_dir, block_size=16, num_blocks=64, dtype="bfloat16")
    seqs = engine.generate(prompts, GREEDY)
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, _ = hf_greedy(model_dir, torch.bfloat16, tuple(prompt))
        assert seq.output_token_ids == want, f"bf16: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", GEMMA)
def test_chunked_prefill_and_swap_preemption_keep_transformers_tokens(make_tiny, arch):
    """Chunks of 32 (each past the window of 12) and a KV pool too small for every sequence
    at once: sequences are swapped out and back in, and every token equals transformers'."""
    model_dir = make_tiny(arch)
    prompts = PROMPTS
    assert_swap_keeps_transformers_tokens(model_dir, prompts, num_blocks=32)


def test_gemma2_defaults_are_its_soft_caps_scale_and_alternating_windows(tmp_path):
    raw = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert (config.head_dim, config.attention_scale, config.hidden_act) == (
        256, 256**-0.5, "gelu_pytorch_tanh"
    )  # fmt: skip
    assert config.embedding_multiplier == 2304**0.5 and config.embedding_multiplier_in_dtype
    assert (config.norm_offset, config.sandwich_norms, config.qk_norm) == (1.0, True, "")
    assert config.sliding_windows[:4] == (4096, None, 4096, None) and not config.layer_ropes
    assert config.tie_word_embeddings and config.eos_token_ids == (1,)


def test_the_tiny_gemma2s_soft_caps_change_transformers_logits(tiny_gemma2):
    """Caps of 5 (attention scores) and 3 (logits) act on the tiny model, so a runtime that
    drops either one fails the logits comparison above."""
    model = hf_model(tiny_gemma2, torch.float32)
    ids = torch.tensor([PROMPTS[3]])
    attn = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():
        capped = model(ids).logits
        try:
            model.config.final_logit_softcapping = None
            no_final_cap = model(ids).logits
            for layer in attn:
                layer.attn_logit_softcapping = None
            no_caps = model(ids).logits
        finally:
            model.config.final_logit_softcapping = 3.0
            for layer in attn:
                layer.attn_logit_softcapping = 5.0
    assert (capped - no_final_cap).abs().max() > 0.1
    assert (no_final_cap - no_caps).abs().max() > 0.01


def test_gemma3_defaults_are_its_scale_windows_ropes_and_no_soft_caps(tmp_path):
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert (config.head_dim, config.attention_scale, config.hidden_act) == (
        256, 256**-0.5, "gelu_pytorch_tanh"
    )  # fmt: skip
    assert config.embedding_multiplier == 2304**0.5 and config.embedding_multiplier_in_dtype
    assert (config.norm_offset, config.sandwich_norms, config.qk_norm) == (1.0, True, "head")
    assert config.attn_logit_softcap is None and config.final_logit_softcap is None
    assert config.tie_word_embeddings and config.eos_token_ids == (1,)
    # every sixth layer full attention (sliding_window_pattern 6), the others windowed
    assert config.sliding_windows[:6] == (4096,) * 5 + (None,)
    assert config.layer_ropes[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.rope_type == "default"


# The plain spelling of Gemma 3 1B's config (rope_theta and rope_local_base_freq, the pattern
# as an int) and the 4B-27B one (the global rope linearly scaled), small
GEMMA3_ROPES = {
    "plain": {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3},
    "linear": {
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {
            "rope_type": "linear", "factor": 8.0,
        },
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(GEMMA3_ROPES))
def test_gemma3_ropes_per_layer_type_are_transformers(tmp_path, name):
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 6, **GEMMA3_ROPES[name],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    theirs = Gemma3RotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    assert set(config.layer_ropes) == {"sliding_attention", "full_attention"}
    for layer_type in ("sliding_attention", "full_attention"):
        inv_freq, scaling = rope_frequencies(config, layer_type)
        assert torch.equal(inv_freq, getattr(theirs, f"{layer_type}_inv_freq"))
        assert scaling == getattr(theirs, f"{layer_type}_attention_scaling")
    local, full = (rope_frequencies(config, t)[0] for t in ("sliding_attention", "full_attention"))
    assert not torch.equal(local, full)


def test_a_multimodal_gemma3_is_refused_naming_its_architecture_and_the_text_model(tmp_path):
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'Gemma3ForConditionalGeneration'.*Gemma3ForCausalLM"):
        load_model_config(tmp_path)


@pytest.mark.parametrize(
    ("field", "value"), [("use_bidirectional_attention", True), ("attn_logit_softcapping", 50.0)]
)
def test_gemma3_fields_transformers_does_not_apply_as_written_are_refused(tmp_path, field, value):
    """Bidirectional attention is not causal decoding; transformers 5.25's Gemma 3 attention
    never passes `attn_logit_softcapping` on: either is refused, naming the field."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", field: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field):
        load_model_config(tmp_path)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3-tied"])
def test_two_tensor_parallel_ranks_keep_transformers_tokens(make_tiny, variant):
    """Each rank holds half the heads (Gemma 3's q/k norm weights whole), its vocabulary slice
    of the scaled embeddings and of the (tied) head, and soft-caps its own logits slice."""
    arch, kwargs, _ = VARIANTS[variant]
    model_dir = make_tiny(arch, **kwargs)
    prompts = [PROMPTS[2], PROMPTS[4]]
    engine = make_engine(model_dir, block_size=8, num_blocks=64, tensor_parallel_size=2)
    try:
        seqs = engine.generate(prompts, GREEDY)
        assert engine.runner.config.num_heads == 2
    finally:
        engine.close()
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, torch.float32, tuple(prompt))[0]


@pytest.mark.parametrize(
    ("arch", "quant"),
    [("gemma2", WeightQuant("int8", lm_head=True)), ("gemma3", WeightQuant("int4", 32))],
    ids=["gemma2-int8-head", "gemma3-int4-g32"],
)
def test_quantized_greedy_equals_transformers_on_the_dequantized_weights(make_tiny, arch, quant):
    """`--quantization`: Gemma's decoder linears (and Gemma 2's soft-capped head) quantized,
    against transformers on the weights they dequantize to."""
    model_dir = make_tiny(arch)
    prompts = [PROMPTS[2], PROMPTS[3]]
    _, seqs = run_engine(model_dir, prompts, quantization=quant, block_size=16, num_blocks=64)
    model = hf_dequantized(model_dir, quant)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy_on(model, prompt), f"{len(prompt)} tokens"


def test_the_tiny_gemma3s_two_ropes_and_norm_offset_are_not_trivial(tiny_gemma3):
    """The tiny checkpoint exercises what a runtime could drop: its norm weights are near 0
    (so (1 + weight) is not weight), and its layers' ropes differ."""
    model = hf_model(tiny_gemma3, torch.float32)
    norm = model.model.layers[0].input_layernorm.weight
    assert norm.abs().mean() < 0.2
    config = load_model_config(tiny_gemma3)
    assert config.layer_ropes == ("sliding_attention", "full_attention")
    assert config.sliding_windows == (12, None)
    assert config.attention_scale != config.head_dim**-0.5


def test_the_embedding_multiplier_is_rounded_to_bf16_as_transformers_rounds_it(tiny_gemma3):
    """Gemma 3 4B's sqrt(2560) = 50.596 is 50.5 in bf16: transformers multiplies by the rounded
    value (the tiny model's sqrt(64) = 8 rounds to itself, so this checks it on its own)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    engine = make_engine(tiny_gemma3, block_size=8, num_blocks=8, dtype="bfloat16")
    model = engine.runner.model
    model.config = replace(model.config, embedding_multiplier=2560**0.5)
    table = model.model.embed_tokens.weight
    theirs = Gemma3TextScaledWordEmbedding(*table.shape, padding_idx=0, embed_scale=2560**0.5)
    theirs.weight.data = table.detach().clone()
    ids = torch.tensor(PROMPTS[4])
    with torch.no_grad():
        assert torch.equal(model._embed(ids), theirs(ids))
