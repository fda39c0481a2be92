"""pagedserve reads a plain config.json itself (a worker then starts without importing
transformers, ~2 s sooner); what it reads must be what transformers' AutoConfig reads, field for
field, defaults and quirks included. Scaled rope still goes through transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.model import config as config_module
from pagedserve.model.activations import ACTIVATIONS
from pagedserve.model.config import load_model_config, model_len

ROOT = Path(__file__).resolve().parents[2]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
OLMO2 = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}
GRANITE = {"architectures": ["GraniteForCausalLM"], "model_type": "granite"}
PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
SMALL = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
}  # fmt: skip

CONFIGS = {
    "llama-all-defaults": LLAMA,
    "mistral-all-defaults": MISTRAL,
    "qwen2-all-defaults": QWEN2,
    "qwen3-all-defaults": QWEN3,
    "olmo2-all-defaults": OLMO2,
    "granite-all-defaults": GRANITE,
    "phi3-all-defaults": PHI3,
    "phi3-window-kv-heads-eos-list": {
        **PHI3, **SMALL, "sliding_window": 47, "eos_token_id": [32000, 32007],
        "rope_theta": 250000.0,
    },
    "mixtral-all-defaults": MIXTRAL,
    "qwen2_moe-all-defaults": QWEN2_MOE,
    "qwen3_moe-all-defaults": QWEN3_MOE,
    "gemma2-all-defaults": GEMMA2,
    "gemma3-all-defaults": GEMMA3,
    "llama-top-level-rope-theta": {**LLAMA, **SMALL, "rope_theta": 500000.0},
    "llama-rope-parameters": {
        **LLAMA, **SMALL, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}
    },
    "llama-legacy-default-rope-scaling": {
        **LLAMA, **SMALL, "rope_scaling": {"type": "default"}, "rope_theta": 20000.0
    },
    "llama-scaling-wins-over-parameters": {
        **LLAMA, **SMALL, "rope_scaling": {"rope_type": "default", "rope_theta": 3e4},
        "rope_parameters": {"rope_type": "default", "rope_theta": 7e4},
    },
    "llama-null-kv-heads-explicit-head-dim": {
        **LLAMA, **SMALL, "num_key_value_heads": None, "head_dim": 32,
    },
    "llama-biases-tied-eos-list": {
        **LLAMA, **SMALL, "attention_bias": True, "mlp_bias": True,
        "tie_word_embeddings": True, "eos_token_id": [2, 7], "bos_token_id": None,
    },
    "llama-gelu-tanh": {**LLAMA, **SMALL, "hidden_act": "gelu_pytorch_tanh"},
    "mistral-null-window": {**MISTRAL, **SMALL, "sliding_window": None, "num_key_value_heads": 2},
    "mistral-window": {
        **MISTRAL, **SMALL, "sliding_window": 64, "attention_bias": True, "num_key_value_heads": 1,
    },
    "qwen2-window-off": {**QWEN2, **SMALL, "sliding_window": 64},
    "qwen2-window-on": {
        **QWEN2, **SMALL, "use_sliding_window": True, "sliding_window": 64,
        "max_window_layers": 1,
    },
    "qwen2-layer-types": {
        **QWEN2, **SMALL, "use_sliding_window": True, "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "qwen2-bf16-null-kv-heads": {
        **QWEN2, **SMALL, "num_key_value_heads": None, "dtype": "bfloat16",
        "eos_token_id": 151645,
    },
    "qwen3-window-on-head-dim-64": {
        **QWEN3, **SMALL, "use_sliding_window": True, "sliding_window": 64,
        "max_window_layers": 2, "head_dim": 64,
    },
    "qwen3-window-off-attention-bias-mlp-bias-ignored": {
        **QWEN3, **SMALL, "sliding_window": 64, "attention_bias": True, "mlp_bias": True,
        "tie_word_embeddings": True, "eos_token_id": [151645, 151643],
    },
    "qwen3-layer-types-null-kv-heads": {
        **QWEN3, **SMALL, "use_sliding_window": True, "sliding_window": 32,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "num_key_value_heads": None,
    },
    "olmo2-attention-bias-head-dim-mlp-bias-ignored": {
        **OLMO2, **SMALL, "attention_bias": True, "mlp_bias": True, "head_dim": 32,
        "num_key_value_heads": None, "tie_word_embeddings": True, "eos_token_id": 100257,
    },
    "granite-multipliers-biases": {
        **GRANITE, **SMALL, "embedding_multiplier": 12, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125, "logits_scaling": 16, "attention_bias": True,
        "mlp_bias": True, "rms_norm_eps": 1e-5, "eos_token_id": 0,
    },
    "mixtral-window-experts-top-1-theta": {
        **MIXTRAL, **SMALL, "sliding_window": 64, "num_local_experts": 4,
        "num_experts_per_tok": 1, "rope_theta": 1e4,
    },
    "qwen2_moe-window-on-no-bias-sparse-step-mlp-only": {
        **QWEN2_MOE, **SMALL, "use_sliding_window": True, "sliding_window": 64,
        "max_window_layers": 2, "qkv_bias": False, "decoder_sparse_step": 2,
        "mlp_only_layers": [2], "norm_topk_prob": True, "shared_expert_intermediate_size": 96,
    },
    "qwen2_moe-no-experts-window-off": {
        **QWEN2_MOE, **SMALL, "num_experts": 0, "sliding_window": 64,
    },
    "qwen3_moe-num-experts-window-on-head-dim-bias": {
        **QWEN3_MOE, **SMALL, "num_experts": 16, "num_experts_per_tok": 2, "head_dim": 32,
        "use_sliding_window": True, "sliding_window": 64, "attention_bias": True,
        "mlp_only_layers": [0], "norm_topk_prob": True,
    },
    "qwen3_moe-window-off-num-local-experts": {
        **QWEN3_MOE, **SMALL, "num_local_experts": 12, "sliding_window": 64,
        "decoder_sparse_step": 3,
    },
    "gemma2-caps-null-window-scalar-bias": {
        **GEMMA2, **SMALL, "head_dim": 32, "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "sliding_window": 16, "query_pre_attn_scalar": 144,
        "attention_bias": True, "mlp_bias": True, "hidden_act": "silu", "rope_theta": 1e4,
        "tie_word_embeddings": False, "eos_token_id": [1, 107],
    },
    "gemma2-layer-types-caps": {
        **GEMMA2, **SMALL, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0,
        "layer_types": ["full_attention", "full_attention", "sliding_attention"],
    },
    # NOTE: Gemma 3 1B's spelling: the pattern as an int, both thetas at the top level
    "gemma3-pattern-thetas-window-softcap-bias": {
        **GEMMA3, **SMALL, "head_dim": 32, "sliding_window_pattern": 2, "sliding_window": 16,
        "rope_theta": 5e5, "rope_local_base_freq": 2e4, "query_pre_attn_scalar": 48,
        "final_logit_softcapping": 30.0, "attention_bias": True, "mlp_bias": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "eos_token_id": [1, 106],
        "tie_word_embeddings": False,
    },
    "gemma3-layer-types-one-kv-head": {
        **GEMMA3, **SMALL, "num_key_value_heads": 1, "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
    },
}  # fmt: skip


def write(tmp_path: Path, raw: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def through_transformers(monkeypatch: pytest.MonkeyPatch, model_dir: Path, **kwargs):
    """`load_model_config` as it reads a config with scaled rope: through AutoConfig."""
    with monkeypatch.context() as patch:
        patch.setattr(config_module, "_plain_rope", lambda raw: None)
        return load_model_config(model_dir, **kwargs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_plain_config_reads_as_transformers_reads_it(name, tmp_path, monkeypatch):
    model_dir = write(tmp_path, CONFIGS[name])
    ours = load_model_config(model_dir)
    assert ours == through_transformers(monkeypatch, model_dir)
    assert ours.hidden_act in ACTIVATIONS


@pytest.mark.parametrize(
    "arch",
    ["llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3",
     "mixtral", "qwen2_moe", "qwen3_moe"],
)  # fmt: skip
def test_the_tiny_models_read_as_transformers_reads_them(make_tiny, arch, monkeypatch):
    model_dir = make_tiny(arch)
    assert load_model_config(model_dir) == through_transformers(monkeypatch, model_dir)
    assert load_model_config(model_dir, dtype="bfloat16") == through_transformers(
        monkeypatch, model_dir, dtype="bfloat16"
    )


def test_the_rope_frequencies_of_a_plain_config_are_transformers(tmp_path, monkeypatch):
    model_dir = write(tmp_path, CONFIGS["llama-top-level-rope-theta"])
    ours = config_module.rope_frequencies(load_model_config(model_dir))
    with monkeypatch.context() as patch:
        patch.setattr(config_module, "_plain_rope", lambda raw: None)
        theirs = config_module.rope_frequencies(load_model_config(model_dir))
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1] == 1.0


# Scaled ropes as config.json files spell them: Llama 3.1's `rope_scaling` beside a top-level
# `rope_theta`, the legacy `type` key, transformers 5's `rope_parameters`
SCALED = {
    "llama3-llama-3.1": {
        **LLAMA, **SMALL, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3",
        },
    },
    "linear-legacy-type": {**LLAMA, **SMALL, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "yarn-legacy-type": {
        **QWEN2, **SMALL, "rope_theta": 1e6, "max_position_embeddings": 131072,
        "rope_scaling": {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        },
    },
    "yarn-parameters-attention-factor-betas": {
        **LLAMA, **SMALL, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 0.8,
            "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 64,
        },
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCALED))
def test_a_scaled_rope_is_transformers_frequencies_and_cos_sin_factor(name, tmp_path, monkeypatch):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = SCALED[name]
    assert config_module._plain_rope(raw) is None
    model_dir = write(tmp_path, raw)
    ours = load_model_config(model_dir)
    assert ours.rope_type == name.split("-")[0]
    inv_freq, scaling = config_module.rope_frequencies(ours)
    theirs = LlamaRotaryEmbedding(AutoConfig.from_pretrained(model_dir))
    assert torch.equal(inv_freq, theirs.inv_freq) and scaling == theirs.attention_scaling
    assert ours == through_transformers(monkeypatch, model_dir)


def test_an_unknown_activation_is_refused_at_load_naming_hidden_act(tmp_path):
    with pytest.raises(ValueError, match="hidden_act 'xielu'"):
        load_model_config(write(tmp_path, {**LLAMA, **SMALL, "hidden_act": "xielu"}))


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_activation_is_transformers_bit_for_bit(name, dtype):
    x = torch.randn(4, 257, generator=torch.Generator().manual_seed(0)).to(dtype) * 4
    assert torch.equal(ACTIVATIONS[name](x), ACT2FN[name](x))


def test_a_worker_loads_a_plain_model_without_importing_transformers(tiny_llama):
    """The start-up this reader buys: both workers' modules, the config and the weights."""
    code = (
        "import sys\n"
        "import pagedserve.decode_worker.server, pagedserve.prefill_worker.server\n"
        "from pagedserve.model.config import load_model_config\n"
        "from pagedserve.model.loader import load_model\n"
        f"load_model(load_model_config({str(tiny_llama)!r}))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'sympy')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_max_model_len_stops_at_the_rope_tables(tiny_llama):
    config = load_model_config(tiny_llama)
    limit = config.max_position_embeddings
    assert model_len(config, None) == limit and model_len(config, 64) == 64
    with pytest.raises(ValueError, match="--max-model-len") as info:
        DecodeEngine.from_model_dir(str(tiny_llama), DecodeEngineConfig(
            block_size=16, num_blocks=8, num_swap_blocks=0, max_model_len=limit + 1))  # fmt: skip
    assert str(limit) in str(info.value)
