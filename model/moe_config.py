"""The mixture-of-experts fields of `ModelConfig` (model/config.py), read from a Mixtral,
Qwen2-MoE or Qwen3-MoE config as transformers' config classes and decoder layers read them."""

from __future__ import annotations

from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def moe_fields(arch: str, hf: Any) -> dict[str, Any]:
    """`ModelConfig`'s MoE fields for a config of `arch` (`hf`: its attributes, defaults filled);
    {} for a dense family.

    Mixtral: every layer sparse, experts of `intermediate_size` features, the top-k weights always
    renormalised and kept in float32. Qwen2-MoE / Qwen3-MoE: layer i is sparse unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (or there are no
    experts), as their decoder layers choose; the others have the dense MLP of
    `intermediate_size`. Raises ValueError naming `num_experts_per_tok` when it exceeds the
    experts.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    layers = hf.num_hidden_layers
    # NOTE: MixtralConfig and Qwen3MoeConfig store `num_experts` as `num_local_experts`
    experts = getattr(hf, "num_local_experts", None)
    if experts is None:
        experts = hf.num_experts
    per_token = hf.num_experts_per_tok
    if arch == "MixtralForCausalLM":
        sparse = (True,) * layers
        fields = {"norm_topk_prob": True, "moe_intermediate_size": hf.intermediate_size}
    else:
        only = set(hf.mlp_only_layers or ())
        step = hf.decoder_sparse_step
        sparse = tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
        fields = {
            "norm_topk_prob": bool(hf.norm_topk_prob),
            "moe_intermediate_size": hf.moe_intermediate_size,
            "shared_expert_intermediate_size": getattr(hf, "shared_expert_intermediate_size", 0),
        }
    if any(sparse) and not 0 < per_token <= experts:
        raise ValueError(
            f"model: num_experts_per_tok {per_token} (config.json) must be 1 to the model's "
            f"{experts} experts"
        )
    return {
        **fields,
        "num_experts": experts,
        "experts_per_token": per_token,
        "sparse_layers": sparse,
        "float32_routing_weights": arch == "MixtralForCausalLM",
    }
