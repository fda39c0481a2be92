"""Qwen3 (`Qwen3ForCausalLM`): Llama's decoder with an RMSNorm over each q and k head before
rope, its own head_dim, o_proj's bias following `attention_bias`, Qwen2's sliding-window rules.
The oracle tests (test_oracle.py, test_model_variants.py, test_native_stack.py) run the tiny
Qwen3 beside the other families; here: what is Qwen3's own (the config's defaults, scheduling
under pressure); its cluster test is in test_family_clusters.py, its GGUF files (llama.cpp's) in
test_gguf_families.py."""

from __future__ import annotations

import json

import torch
from support.oracle import GREEDY, hf_greedy, make_engine, make_prompts

from pagedserve.model.config import load_model_config


def test_qwen3_defaults_are_its_own_head_dim_q_k_norms_and_no_biases(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    config = load_model_config(tmp_path)
    assert (config.hidden_size, config.num_heads, config.head_dim) == (4096, 32, 128)
    assert config.qk_norm and not (config.qkv_bias or config.o_bias or config.mlp_bias)
    assert config.sliding_windows == (None,) * 32


def test_two_tensor_parallel_ranks_keep_transformers_tokens(tiny_qwen3):
    """Each rank holds half the heads and the whole (replicated) q/k norm weights."""
    prompts = make_prompts((6, 40), seed=13)
    engine = make_engine(tiny_qwen3, block_size=8, num_blocks=64, tensor_parallel_size=2)
    try:
        seqs = engine.generate(prompts, GREEDY)
        assert engine.runner.config.num_heads == 2
    finally:
        engine.close()
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(tiny_qwen3, torch.float32, tuple(prompt))[0]
