"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`, model/phi3.py): fused qkv_proj and
gate_up_proj weights loaded into our q/k/v and gate/up, rope over the first
partial_rotary_factor of each head, one sliding window on every layer, and LongRoPE served with
its short factors where no sequence can outgrow original_max_position_embeddings (refused at
worker start otherwise). test_oracle.py runs the tiny Phi-3 beside the other families (fp32
tokens and logits at three block sizes, mixed prompt lengths batched together), and
test_native_stack.py checks that the one-call stack declines partial rotary; here: what is its
own."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from support.oracle import (
    assert_swap_keeps_transformers_tokens,
    hf_greedy,
    make_engine,
    make_prompts,
    run_engine,
)

from pagedserve.model import config as config_module
from pagedserve.model import phi3
from pagedserve.model.config import load_model_config
from pagedserve.model.llama import RotaryEmbedding
from pagedserve.model.quant import weight_quant

PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
# Phi-4-mini-instruct's config.json as it spells rope: a top-level partial_rotary_factor,
# `rope_scaling` with the legacy `type`, original_max_position_embeddings beside it
PHI4_MINI = {
    **PHI3, "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 200064,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "sliding_window": 262144,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(48)],
        "long_factor": [1.5 + 0.5 * i for i in range(48)],
    },
    "tie_word_embeddings": True,
}  # fmt: skip


def _write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_phi3_defaults_are_phi3configs(tmp_path):
    config = load_model_config(_write(tmp_path, PHI3))
    assert (config.vocab_size, config.hidden_size, config.head_dim) == (32064, 3072, 96)
    assert (config.rms_norm_eps, config.eos_token_ids, config.bos_token_id) == (1e-5, (32000,), 1)
    assert config.rope_dim == 96 and config.rope_type == "default"
    assert config.sliding_windows == (None,) * 32
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)


def test_phi4_minis_rope_reads_as_transformers_rotary_embedding(tmp_path):
    """rotary_dim 96 of head_dim 128; short factors and the attention factor
    sqrt(1 + ln 32 / ln 4096), as Phi3RotaryEmbedding initialises them."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = load_model_config(_write(tmp_path, PHI4_MINI))
    assert (config.head_dim, config.rope_dim, config.rope_type) == (128, 96, "longrope")
    assert config.original_max_position_embeddings == 4096
    assert config.sliding_windows == (262144,) * 32
    inv_freq, scaling = config_module.rope_frequencies(config)
    theirs = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    assert torch.equal(inv_freq, theirs.inv_freq) and scaling == theirs.attention_scaling
    assert scaling != 1.0


def test_the_checkpoints_fused_weights_fill_the_fused_projections_as_they_are(tiny_phi3):
    """qkv_proj (rows q, k, v) and gate_up_proj (gate, then up) land, unchanged, in the
    buffers that q/k/v and gate/up are row slices of."""
    engine = make_engine(tiny_phi3, block_size=8, num_blocks=8)
    layer = engine.runner.model.model.layers[1]
    with safe_open(str(tiny_phi3 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    assert torch.equal(layer.self_attn.fused_weight, qkv)
    assert torch.equal(layer.self_attn.k_proj.weight, qkv[64:96])
    assert torch.equal(layer.mlp.fused_weight, gate_up)
    assert torch.equal(layer.mlp.up_proj.weight, gate_up[128:])


def test_a_fused_weight_of_the_wrong_rows_is_named():
    sizes = phi3.fused_row_sizes(4, 2, 16, 128)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_up_proj.weight has 250 rows"):
        phi3.split_fused("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(250, 64), sizes)


def test_bfloat16_greedy_tokens_match_transformers(tiny_phi3):
    """The partial rotation's pass-through dims are concatenated in bf16, as transformers does."""
    prompts = make_prompts((1, 17, 70), seed=9)
    _, seqs = run_engine(tiny_phi3, prompts, block_size=16, num_blocks=64, dtype="bfloat16")
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, _ = hf_greedy(tiny_phi3, torch.bfloat16, tuple(prompt))
        assert seq.output_token_ids == want, f"prompt of {len(prompt)} tokens"


def test_chunked_prefill_swap_preemption_and_a_sliding_window_keep_transformers_tokens(
    make_tiny,
):
    """A window of 24 on both layers (Phi3 applies config.sliding_window to every layer), 32-token
    chunks beside decodes, and a KV pool too small for every sequence: swapped out and back in,
    every token is still transformers'."""
    model_dir = make_tiny("phi3", sliding_window=24)
    assert load_model_config(model_dir).sliding_windows == (24, 24)
    prompts = make_prompts((3, 90, 20, 150, 1, 64), seed=11)
    assert_swap_keeps_transformers_tokens(model_dir, prompts, num_blocks=40)


def test_longrope_within_the_original_context_is_transformers_tokens_and_logits(
    tiny_phi3_longrope,
):
    """--max-model-len 64 = original_max_position_embeddings: every position transformers
    computes uses short_factor (and the attention factor), as pagedserve's tables do."""
    prompts = make_prompts((1, 7, 20, 32), seed=5)
    engine, seqs = run_engine(
        tiny_phi3_longrope, prompts, record_logits=True, block_size=8, num_blocks=64,
        max_model_len=64,
    )  # fmt: skip
    for prompt, seq in zip(prompts, seqs, strict=True):
        want_tokens, want_logits = hf_greedy(tiny_phi3_longrope, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        err = (torch.stack(engine.logits[seq.request_id]) - want_logits).abs().max().item()
        assert err < 1e-4, f"prompt of {len(prompt)}: max |logit diff| {err:.2e}"


def test_longrope_tables_are_transformers_short_ones_and_not_its_long_ones(tiny_phi3_longrope):
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = RotaryEmbedding(load_model_config(tiny_phi3_longrope))
    theirs = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tiny_phi3_longrope))
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = theirs(x, torch.arange(64)[None])  # the longest position + 1 = 64: short
    assert torch.equal(rope.cos[:64], cos[0]) and torch.equal(rope.sin[:64], sin[0])
    long_cos, _ = theirs(x, torch.arange(65)[None])  # 65 > 64: long, for every position
    assert not torch.allclose(rope.cos[:64], long_cos[0, :64])


@pytest.mark.parametrize("max_model_len", [None, 65])
def test_longrope_past_the_original_context_is_refused_at_start_naming_the_flag(
    tiny_phi3_longrope, max_model_len
):
    with pytest.raises(ValueError, match="--max-model-len") as info:
        make_engine(tiny_phi3_longrope, block_size=8, num_blocks=8, max_model_len=max_model_len)
    assert "original_max_position_embeddings 64" in str(info.value)


def test_tensor_parallelism_and_quantization_are_refused_naming_the_flags(tiny_phi3):
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 .*Phi3ForCausalLM"):
        make_engine(tiny_phi3, block_size=8, num_blocks=8, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--quantization int8.*Phi3ForCausalLM"):
        make_engine(tiny_phi3, block_size=8, num_blocks=8, quantization=weight_quant("int8"))
