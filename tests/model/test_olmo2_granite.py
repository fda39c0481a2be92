"""OLMo 2 (`Olmo2ForCausalLM`: norms after attention and the MLP instead of before, RMSNorms
over the whole q and k projections before rope, norm weights and rope applied in float32) and
Granite (`GraniteForCausalLM`: Llama's layer with an embedding multiplier, scaled residual
branches, `attention_multiplier` as the attention's scale, logits divided by `logits_scaling`).
The oracle tests (test_oracle.py, test_native_stack.py, test_config_reader.py) run both tiny
models beside the other families; here: what is their own (the configs' defaults, scheduling
under pressure — for Qwen3 too —, tensor parallelism, a GGUF refused). No cluster test: the
end-to-end cluster (test_qwen3.py) is started for one model, and another costs the suite a
cluster start."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGUFWriter
from support.oracle import (
    GREEDY,
    assert_swap_keeps_transformers_tokens,
    hf_greedy,
    make_engine,
    make_prompts,
)

from pagedserve.fetch_model import fetch_model
from pagedserve.model.config import load_model_config


def test_olmo2_defaults_are_post_norms_and_q_k_norms_over_the_projections(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Olmo2ForCausalLM"]}))
    config = load_model_config(tmp_path)
    assert (config.vocab_size, config.head_dim, config.rms_norm_eps) == (50304, 128, 1e-5)
    assert (config.qk_norm, config.post_norms, config.late_casts) == ("projection", True, True)
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)
    assert config.eos_token_ids == (50279,)


def test_granite_defaults_are_multipliers_of_one_and_an_attention_scale_of_one(tmp_path):
    """GraniteConfig's `attention_multiplier` defaults to 1.0: the scale, not 1 / sqrt(D)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GraniteForCausalLM"]}))
    config = load_model_config(tmp_path)
    assert config.attention_multiplier == 1.0
    assert (config.embedding_multiplier, config.residual_multiplier) == (1.0, 1.0)
    assert config.logits_scaling == 1.0 and not config.qk_norm and not config.post_norms


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "granite"])
def test_chunked_prefill_and_swap_preemption_keep_transformers_tokens(make_tiny, arch):
    """Small chunks and a KV pool too small for every sequence at once: sequences are
    swapped out and back in, and every token still equals transformers'."""
    model_dir = make_tiny(arch)
    prompts = make_prompts((3, 90, 20, 150, 1, 64), seed=11)
    assert_swap_keeps_transformers_tokens(model_dir, prompts, num_blocks=40)


def test_two_tensor_parallel_ranks_keep_granites_tokens(make_tiny):
    """Each rank multiplies the gathered embeddings and scales its own logits slice."""
    model_dir = make_tiny("granite")
    prompts = make_prompts((6, 40), seed=13)
    engine = make_engine(model_dir, block_size=8, num_blocks=64, tensor_parallel_size=2)
    try:
        seqs = engine.generate(prompts, GREEDY)
    finally:
        engine.close()
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, torch.float32, tuple(prompt))[0]


def test_olmo2_refuses_tensor_parallelism_naming_the_flag(make_tiny):
    """Its q/k norms average over every head; a rank holds only its own heads."""
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 .*OLMo 2"):
        make_engine(make_tiny("olmo2"), block_size=8, num_blocks=64, tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["olmo2", "granite"])
def test_an_olmo2_or_granite_gguf_is_refused_before_conversion_naming_it(tmp_path, arch):
    gguf = tmp_path / f"tiny-{arch}.gguf"
    writer = GGUFWriter(str(gguf), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"'{arch}' GGUF.*llama") as info:
        fetch_model(str(gguf), tmp_path / "out")
    assert "safetensors" in str(info.value)
    assert not (tmp_path / "out").exists()
