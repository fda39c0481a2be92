"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): Llama's layer (no biases, one
`sliding_window` on every layer when set) with three differences, all handled as data:

- The checkpoint fuses q/k/v into `self_attn.qkv_proj` (rows: q, then k, then v) and gate/up
  into `mlp.gate_up_proj` (first half gate, second half up). `split_fused` gives their row
  blocks our names (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`); the loader copies
  them into those parameters, which `fuse_rows` has already laid out as one buffer in the same
  order, so the weights end up fused as the checkpoint stores them.
- `partial_rotary_factor` (Phi-4-mini: 0.75): rope rotates the first
  rotary_dim = int(head_dim * factor) dims of each head and passes the rest through
  (`ModelConfig.rotary_dim`, model/llama.py `rotate`).
- LongRoPE (`rope_scaling.type` "longrope", Phi-3-*-128k, Phi-3.5, Phi-4-mini). transformers
  computes each forward's frequencies from the longest position in it: short_factor while the
  sequence is at most original_max_position_embeddings long, long_factor beyond, and when a
  generation first grows past it, `Phi3ForCausalLM.prepare_inputs_for_generation` drops the
  cache and recomputes every earlier key with long_factor. pagedserve's rope tables are fixed
  and its cached keys are never re-rotated, so it serves longrope exactly only where no
  sequence can grow past original_max_position_embeddings: `check_longrope_len` refuses a
  worker whose served length (--max-model-len, else max_position_embeddings) is longer. Within
  it every position uses short_factor and the attention factor, as transformers does.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHITECTURE = "Phi3ForCausalLM"

# Phi3Config's defaults for the fields pagedserve reads (checked against AutoConfig in
# tests/model/test_config_reader.py). NOTE: Phi3Config has no head_dim: hidden / heads.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 32000, "tie_word_embeddings": False,
    "sliding_window": None,
}  # fmt: skip

# checkpoint name suffix -> (our names of its row blocks, in order)
FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}  # fmt: skip


def rope_fields(arch: str, hf: Any, head_dim: int, rope_type: str) -> dict[str, Any]:
    """ModelConfig's `rotary_dim` and `original_max_position_embeddings` for a Phi-3 config;
    {} for the other families. ValueError naming `partial_rotary_factor` for a factor other
    than 1 on another family (their transformers layers rotate whole heads) or an odd
    rotary_dim."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = float(params.get("partial_rotary_factor") or 1.0)
    if arch != ARCHITECTURE:
        if factor != 1.0:
            raise ValueError(
                f"model: partial_rotary_factor {factor} (config.json) is supported for "
                f"{ARCHITECTURE} only; {arch} rotates whole heads"
            )
        return {}
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"model: partial_rotary_factor {factor} of head_dim {head_dim} gives rotary_dim "
            f"{rotary_dim}; pagedserve rotates an even number of dims, at least 2"
        )
    original = params.get("original_max_position_embeddings") if rope_type == "longrope" else None
    return {
        "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
        "original_max_position_embeddings": original,
    }


def check_longrope_len(rope_type: str, original: int | None, served: int) -> None:
    """ValueError naming --max-model-len when a longrope model would serve sequences longer
    than its original_max_position_embeddings (see the module docstring: transformers then
    re-rotates every key with long_factor, which fixed tables cannot)."""
    if rope_type != "longrope" or original is None or served <= original:
        return
    raise ValueError(
        f"--max-model-len: a longrope model serves at most its original_max_position_embeddings "
        f"{original} (config.json), not {served} (--max-model-len, else max_position_embeddings): "
        "past it transformers switches every position of a "
        "sequence to long_factor, re-rotating its cached keys, which pagedserve does not; "
        f"serve this model with --max-model-len {original} or less (docs/models.md)"
    )


def split_fused(
    name: str, tensor: torch.Tensor, row_sizes: dict[str, tuple[int, ...]]
) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] for an ordinary checkpoint tensor; for a fused Phi-3 weight
    (`FUSED`), its row blocks under our names, sized by `row_sizes[suffix]`. ValueError naming
    the tensor when its rows are not their sum."""
    for suffix, parts in FUSED.items():
        if not name.endswith("." + suffix):
            continue
        sizes = row_sizes[suffix]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(
                f"model: {name} has {tensor.shape[0]} rows, want {sum(sizes)} ({sizes})"
            )
        prefix = name[: -len(suffix)]
        return [(prefix + p, rows) for p, rows in zip(parts, tensor.split(sizes), strict=True)]
    return [(name, tensor)]


def fused_row_sizes(
    num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int
) -> dict[str, tuple[int, ...]]:
    """The row blocks of each `FUSED` weight: q, k, v; gate, up."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "self_attn.qkv_proj.weight": (q, kv, kv),
        "mlp.gate_up_proj.weight": (intermediate_size, intermediate_size),
    }
