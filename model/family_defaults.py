"""The defaults of transformers' config classes for the fields pagedserve reads
(model/config.py), family by family: what a config.json that leaves a field out means."""

from __future__ import annotations

from typing import Any

from pagedserve.model import phi3

# The defaults transformers' config classes (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
# Olmo2Config, GraniteConfig, Gemma2Config, Gemma3TextConfig, MixtralConfig, Qwen2MoeConfig,
# Qwen3MoeConfig) give the fields pagedserve reads when config.json leaves them out
# (tests/model/test_config_reader.py checks every one against AutoConfig).
DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
    },
    "MistralForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None,
    },
    "Qwen3ForCausalLM": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": None,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
    },
    # NOTE: Olmo2Config and GraniteConfig have no head_dim field: hidden / heads unless given
    "Olmo2ForCausalLM": {
        "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "bos_token_id": None, "eos_token_id": 50279, "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "GraniteForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "embedding_multiplier": 1.0,
        "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
    },
    "Phi3ForCausalLM": phi3.DEFAULTS,
    # NOTE: MixtralConfig's rope_theta defaults to 1e6 (`DEFAULT_THETAS`); its experts have
    # `intermediate_size` features
    "MixtralForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
    },
    # NOTE: Qwen2MoeConfig's `sliding_window` is 0, not None, when `use_sliding_window` is off
    "Qwen2MoeForCausalLM": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None, "qkv_bias": True, "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
        "mlp_only_layers": None,
    },
    # NOTE: Qwen3MoeConfig has no head_dim field (hidden / heads unless given) and stores
    # `num_experts` as `num_local_experts`
    "Qwen3MoeForCausalLM": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_local_experts": 128, "norm_topk_prob": False, "mlp_only_layers": None,
    },
    "Gemma2ForCausalLM": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None,
    },
    "Gemma3ForCausalLM": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": True, "attention_bias": False,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
}  # fmt: skip
DEFAULT_THETAS = {"MixtralForCausalLM": 1_000_000.0}
# Gemma3TextConfig's default rope thetas: full attention's, sliding attention's
GEMMA3_THETAS = (1_000_000.0, 10_000.0)
DEFAULT_ROPE_THETA = 10_000.0
