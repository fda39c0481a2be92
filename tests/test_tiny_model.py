"""make_tiny_model: offline checkpoints that transformers loads back, with a real tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.tiny_model import make_tiny_model

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
BOS, EOS, PAD = 0, 1, 2

Builder = Callable[..., Path]


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Builder:
    """make_tiny_model(**kwargs), built once per distinct kwargs for the whole session."""
    cache: dict[str, Path] = {}

    def _build(**kwargs: Any) -> Path:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp("tiny"), **kwargs)
        return cache[key]

    return _build


def file_digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", sorted(ARCH_CLASSES))
def test_each_arch_loads_back_with_its_class_and_shapes(build: Builder, arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(build(arch=arch)).eval()
    cfg = model.config
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 512)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS, EOS, PAD)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 16, 64)  # kv_heads * head_dim, hidden
    with torch.no_grad():
        logits = model(torch.tensor([[BOS, 40, 41, 42]])).logits
    assert logits.shape == (1, 4, 512)
    assert torch.isfinite(logits).all()


def test_qwen2_has_nonzero_qkv_biases(build: Builder) -> None:
    attn = AutoModelForCausalLM.from_pretrained(build(arch="qwen2")).model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None
        assert proj.bias.abs().min() > 0
        assert proj.bias.std() > 0.05
    assert attn.o_proj.bias is None


def test_qwen3_has_random_q_k_norms_over_its_own_head_dim(build: Builder) -> None:
    model = AutoModelForCausalLM.from_pretrained(build(arch="qwen3"))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.head_dim == 32 != model.config.hidden_size // 4
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 32, 64) and attn.o_proj.weight.shape == (64, 4 * 32)
    for norm in (attn.q_norm, attn.k_norm):
        assert norm.weight.shape == (32,) and norm.weight.std() > 0.05
    assert all(p.bias is None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))


def test_qwen3_sliding_window_covers_the_upper_half_of_the_layers(build: Builder) -> None:
    config = AutoModelForCausalLM.from_pretrained(build(arch="qwen3", sliding_window=8)).config
    assert (config.use_sliding_window, config.sliding_window) == (True, 8)
    assert config.layer_types == ["full_attention", "sliding_attention"]


def test_olmo2_has_post_norms_and_random_q_k_norms_over_the_projections(build: Builder) -> None:
    layer = AutoModelForCausalLM.from_pretrained(build(arch="olmo2")).model.layers[0]
    assert not hasattr(layer, "input_layernorm")
    attn = layer.self_attn
    for norm, size in ((attn.q_norm, 4 * 16), (attn.k_norm, 2 * 16),
                       (layer.post_feedforward_layernorm, 64)):  # fmt: skip
        assert norm.weight.shape == (size,) and norm.weight.std() > 0.05


def test_granite_multipliers_are_none_of_them_one(build: Builder) -> None:
    config = AutoModelForCausalLM.from_pretrained(build(arch="granite")).config
    multipliers = (config.embedding_multiplier, config.residual_multiplier,
                   config.attention_multiplier, config.logits_scaling)  # fmt: skip
    assert multipliers == (12.0, 0.22, 0.15, 8.0)
    assert config.attention_multiplier != 16**-0.5


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_mixtures_of_experts_have_8_random_experts_2_per_token(build: Builder, arch) -> None:
    """Qwen2-MoE's shared expert and its gate are random; Qwen3-MoE's last layer is dense."""
    model = AutoModelForCausalLM.from_pretrained(build(arch=arch))
    assert type(model).__name__.lower().startswith(arch.replace("_", ""))
    config, mlp = model.config, model.model.layers[0].mlp
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    inner = 128 if arch == "mixtral" else 32
    assert mlp.experts.gate_up_proj.shape == (8, 2 * inner, 64)
    assert mlp.experts.down_proj.std() > 0.05 and mlp.gate.weight.std() > 0.05
    if arch == "qwen2_moe":
        assert mlp.shared_expert.up_proj.weight.shape == (128, 64)
        assert mlp.shared_expert_gate.weight.std() > 0.05
        assert not config.norm_topk_prob
    if arch == "qwen3_moe":
        assert config.mlp_only_layers == [1] and config.norm_topk_prob
        assert type(model.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"


def test_norm_weights_are_random_around_one(build: Builder) -> None:
    model = AutoModelForCausalLM.from_pretrained(build())
    for norm in (model.model.norm, model.model.layers[1].input_layernorm):
        weight = norm.weight.detach()
        assert not torch.allclose(weight, torch.ones_like(weight), atol=1e-2)
        assert abs(weight.mean().item() - 1.0) < 0.1


def test_llama_and_mistral_have_no_biases(build: Builder) -> None:
    for arch in ("llama", "mistral"):
        attn = AutoModelForCausalLM.from_pretrained(build(arch=arch)).model.layers[0].self_attn
        assert attn.q_proj.bias is None


def test_bfloat16_checkpoint_is_stored_and_loaded_as_bfloat16(build: Builder) -> None:
    path = build(dtype="bfloat16")
    with safe_open(path / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (not a dict)
    assert dtypes == {"BF16"}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "text",
    ["Hello, world! The block pool has 16 free blocks.", "café 日本語 🙂", "a , b\n\n\tc  d "],
)
def test_tokenizer_round_trips_text_and_prepends_bos(build: Builder, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(build())
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS
    assert BOS not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_special_ids_match_configs(build: Builder) -> None:
    path = build()
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
    assert tok.convert_ids_to_tokens([BOS, EOS, PAD]) == ["<s>", "</s>", "<pad>"]
    assert len(tok) == 512
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS, EOS, PAD)


def test_tokenizer_learns_multibyte_merges(build: Builder) -> None:
    tok = AutoTokenizer.from_pretrained(build())
    assert len(tok("é", add_special_tokens=False)["input_ids"]) == 1  # two UTF-8 bytes
    assert len(tok("café", add_special_tokens=False)["input_ids"]) < len("café".encode())


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"arch": "qwen2", "seed": 3, "dtype": "bfloat16"}
    first = file_digests(make_tiny_model(tmp_path / "a", **kwargs))
    second = file_digests(make_tiny_model(tmp_path / "b", **kwargs))
    assert set(first) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert first == second


def test_different_seed_gives_different_weights(build: Builder) -> None:
    a = file_digests(build(seed=0))
    b = file_digests(build(seed=1))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_unknown_arch_raises_value_error_naming_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, arch="gpt2")


def test_sliding_window_on_llama_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        make_tiny_model(tmp_path, arch="llama", sliding_window=8)


def test_mistral_records_sliding_window(build: Builder) -> None:
    model = AutoModelForCausalLM.from_pretrained(build(arch="mistral", sliding_window=8))
    assert model.config.sliding_window == 8


def test_linear_rope_scaling_round_trips_into_loaded_config(build: Builder) -> None:
    path = build(rope_scaling={"rope_type": "linear", "factor": 2.0})
    rope = AutoModelForCausalLM.from_pretrained(path).config.rope_parameters
    assert rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def test_default_rope_round_trips_into_loaded_config(build: Builder) -> None:
    rope = AutoModelForCausalLM.from_pretrained(build()).config.rope_parameters
    assert rope == {"rope_type": "default", "rope_theta": 10000.0}


def test_llama3_rope_scaling_round_trips_into_loaded_config(build: Builder) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    rope = AutoModelForCausalLM.from_pretrained(build(rope_scaling=scaling)).config.rope_parameters
    assert rope == {**scaling, "rope_theta": 10000.0}
