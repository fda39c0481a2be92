"""Mixtures of experts (model/moe.py): Mixtral (`MixtralForCausalLM`: every layer sparse, top-k
weights renormalised and kept in float32, Mistral's attention), Qwen2-MoE (`Qwen2MoeForCausalLM`:
top-k weights not renormalised here, a shared expert scaled by sigmoid(shared_expert_gate(x)),
qkv biases) and Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3's q/k norms, a dense layer among the
sparse ones by `mlp_only_layers`) against transformers, token for token; their checkpoint names,
config defaults, and what is refused. No cluster test: one cluster per model costs the suite a
cluster start (the workers run the same engine)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.oracle import (
    assert_swap_keeps_transformers_tokens,
    hf_greedy,
    make_engine,
    make_prompts,
    run_engine,
)

from pagedserve.model.config import load_model_config, rope_frequencies
from pagedserve.model.loader import load_model
from pagedserve.model.moe import SparseMoeBlock
from pagedserve.model.native_stack import NativeStack
from pagedserve.model.quant import weight_quant

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
# Shared by the tests below, so that transformers generates each prompt's tokens once
PROMPTS = make_prompts((3, 90, 20, 150), seed=11)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_and_logits_match_transformers_in_mixed_batches(make_tiny, arch):
    """Prompts of 1 to 150 tokens prefilled and decoded side by side: each step's tokens go to
    their experts in one batch."""
    model_dir = make_tiny(arch)
    engine, seqs = run_engine(model_dir, PROMPTS, record_logits=True, block_size=16, num_blocks=128)
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        want_tokens, want_logits = hf_greedy(model_dir, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        max_err = (torch.stack(engine.logits[seq.request_id]) - want_logits).abs().max().item()
        assert max_err < 1e-4, f"prompt of {len(prompt)}: max |logit diff| {max_err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_swap_preemption_keep_transformers_tokens(make_tiny, arch):
    """Chunks of 32 tokens and a KV pool too small for every sequence at once: sequences are
    swapped out and back in, and every token still equals transformers'."""
    model_dir = make_tiny(arch)
    assert_swap_keeps_transformers_tokens(model_dir, PROMPTS, num_blocks=30)


NEAR_TIE = 0.25  # bf16 logits: the spacing of values of a few units (docs/models.md)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_tokens_equal_transformers_or_first_differ_at_a_near_tie(make_tiny, arch):
    """In bf16 each prompt's tokens equal transformers', or first differ where transformers'
    own top logit and the logit of the token chosen here are within NEAR_TIE (the margins are
    printed, as the real model's bf16 test reports them). Mixtral's weighted expert outputs
    are summed in float32 before the cast, Qwen's in bf16, as transformers sums them."""
    model_dir = make_tiny(arch)
    prompts = PROMPTS[:2]
    _, seqs = run_engine(model_dir, prompts, block_size=16, num_blocks=128, dtype="bfloat16")
    margins = []
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, logits = hf_greedy(model_dir, torch.bfloat16, tuple(prompt))
        got = seq.output_token_ids
        step = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if step is None:
            continue
        margin = float(logits[step].max() - logits[step][got[step]])
        margins.append((len(prompt), step, round(margin, 4)))
        assert margin <= NEAR_TIE, f"prompt of {len(prompt)} differs at step {step}: {margin}"
    print(f"{arch} bf16: (prompt length, step, margin) of the prompts that differ: {margins}")


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_are_routed_to_different_experts(make_tiny, arch):
    """The tiny models' routers are not degenerate: tokens pick many different experts, so a
    wrong expert's weights or a wrong choice changes the tokens."""
    model = load_model(load_model_config(make_tiny(arch)))
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = model.model.layers[0].post_attention_layernorm(model.model.embed_tokens.weight[3:131])
    _, ids = block.route(x)
    assert ids.shape == (128, 2)
    assert len(set(ids[:, 0].tolist())) >= 6, "first choices must spread over the experts"
    assert len({tuple(sorted(pair)) for pair in ids.tolist()}) >= 12


def test_qwen3_moe_has_a_dense_layer_by_mlp_only_layers(tiny_qwen3_moe):
    config = load_model_config(tiny_qwen3_moe)
    assert config.sparse_layers == (True, False) and config.qk_norm == "head"
    model = load_model(config)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoeBlock", "MLP"]


@pytest.mark.parametrize(
    ("arch", "names"),
    [
        ("mixtral", ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.7.w1.weight",
                     "block_sparse_moe.experts.7.w2.weight",
                     "block_sparse_moe.experts.7.w3.weight")),
        ("qwen2_moe", ("mlp.gate.weight", "mlp.experts.7.gate_proj.weight",
                       "mlp.experts.7.up_proj.weight", "mlp.experts.7.down_proj.weight",
                       "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight")),
    ],
)  # fmt: skip
def test_the_checkpoints_name_each_expert_as_real_checkpoints_do(make_tiny, arch, names):
    """transformers 5 writes the per-expert names of the published checkpoints (it stacks the
    experts in memory only); the oracle tests above load them."""
    with safe_open(str(make_tiny(arch) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {f"model.layers.1.{name}" for name in names} <= keys


def _stacked_checkpoint(model_dir, out):
    """`model_dir` rewritten with each layer's experts as transformers holds them in memory:
    `mlp.experts.gate_up_proj` [E, 2 x inner, hidden] and `mlp.experts.down_proj`."""
    shutil.copytree(model_dir, out)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        parts = {p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(8)]
                 for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        gate_up = [
            torch.cat(pair) for pair in zip(parts["gate_proj"], parts["up_proj"], strict=True)
        ]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(parts["down_proj"])
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_stacked_expert_tensors_load_as_the_per_expert_ones(tiny_qwen2_moe, tmp_path):
    per_expert = load_model(load_model_config(tiny_qwen2_moe)).state_dict()
    stacked_dir = _stacked_checkpoint(tiny_qwen2_moe, tmp_path / "stacked")
    stacked = load_model(load_model_config(stacked_dir)).state_dict()
    assert per_expert.keys() == stacked.keys()
    assert all(torch.equal(per_expert[k], stacked[k]) for k in per_expert)


def test_a_missing_expert_is_named(tiny_mixtral, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_mixtral, out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    del tensors["model.layers.0.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing.*layers\.0\.mlp\.experts\.5\.up"):
        load_model(load_model_config(out))


MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}


def _config(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_model_config(tmp_path)


def test_mixtral_defaults_are_8_experts_2_per_token_renormalised_and_a_rope_theta_of_1e6(
    tmp_path,
):
    config = _config(tmp_path, MIXTRAL)
    assert (config.num_experts, config.experts_per_token, config.norm_topk_prob) == (8, 2, True)
    assert config.moe_intermediate_size == config.intermediate_size == 14336
    assert config.sparse_layers == (True,) * 32 and config.float32_routing_weights
    assert config.sliding_windows == (None,) * 32 and config.num_kv_heads == 8
    inv_freq, _ = rope_frequencies(config)
    assert inv_freq[1].item() == pytest.approx(1e6 ** (-2 / 128))


def test_qwen_moe_defaults(tmp_path):
    qwen2 = _config(tmp_path, QWEN2_MOE)
    assert (qwen2.num_experts, qwen2.experts_per_token, qwen2.norm_topk_prob) == (60, 4, False)
    assert (qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size) == (1408, 5632)
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sparse_layers == (True,) * 24
    qwen3 = _config(tmp_path, QWEN3_MOE)
    assert (qwen3.num_experts, qwen3.experts_per_token, qwen3.norm_topk_prob) == (128, 8, False)
    assert (qwen3.moe_intermediate_size, qwen3.shared_expert_intermediate_size) == (768, 0)
    assert qwen3.qk_norm == "head" and qwen3.head_dim == 2048 // 32


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step(tmp_path):
    config = _config(tmp_path, {
        **QWEN3_MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3],
        "num_experts": 16,
    })  # fmt: skip
    assert config.sparse_layers == (False, True, False, False, False, True)
    assert config.num_experts == 16


def test_quantization_is_refused_naming_the_flag(tiny_qwen3_moe):
    with pytest.raises(ValueError, match=r"--quantization int8: Qwen3MoeForCausalLM"):
        load_model_config(tiny_qwen3_moe, quantization=weight_quant("int8"))


def test_tensor_parallelism_is_refused_naming_the_flag(tiny_mixtral):
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 .*mixture of experts"):
        make_engine(tiny_mixtral, block_size=8, num_blocks=64, tensor_parallel_size=2)


def test_the_native_stack_declines_a_mixture_of_experts(tiny_qwen2_moe):
    engine = make_engine(tiny_qwen2_moe, block_size=8, num_blocks=32)
    assert NativeStack.build(engine.runner.model, engine.runner.kv_cache) is None
