"""GGUF files of the families transformers' GGUF reader gets wrong, read right.

`pagedserve fetch-model` reads a GGUF with transformers' own reader. For llama, mistral and
qwen2 files it is exact as it is. For the architectures here it misreads what llama.cpp's
converter (`convert_hf_to_gguf.py`) writes; `load_model` builds the config from transformers'
reading plus these corrections, then loads the tensors transformers dequantizes, corrected too:

- qwen3, qwen3moe: head_dim is `attention.key_length` (transformers takes Qwen3Config's 128).
- gemma2, gemma3: the attention scale is not in the file: llama.cpp uses 1 / sqrt(head_dim),
  or 1 / sqrt(hidden / heads) for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), and so
  do we (`query_pre_attn_scalar`); gemma2's soft-caps are read (transformers keeps 50 and 30);
  gemma3's layer pattern (`attention.sliding_window_pattern`, default: every 6th layer full,
  as llama.cpp), its full layers' rope scaling (`rope.scaling.type` / `factor`) and its
  sliding layers' rope base (`rope.freq_base_swa`). Norm weights
  are stored with the 1 added; transformers subtracts it (exact in the `1 + w` Gemma computes).
- phi3: `rope.dimension_count` gives `partial_rotary_factor`, `attention.sliding_window` the
  window (0: none), `rope.scaling.original_context_length` the original context, and the
  `rope_factors_short` / `rope_factors_long` tensors (Phi-3.5 / Phi-4-mini) a longrope rope
  (its attention factor is the formula both llama.cpp and transformers compute).
- qwen2moe, qwen3moe: the experts' width (`expert_feed_forward_length`); qwen2moe's shared
  expert's (`expert_shared_feed_forward_length`) and its gate's shape.
- a llama file with `expert_count` (Mixtral): a Mixtral config, and its router and expert
  tensors (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`), which transformers' reader drops.

Contract: `load_model(gguf, arch, dtype)` returns a transformers model whose weights and config
are those of the checkpoint llama.cpp converted (fp32: the same values), or raises ValueError
naming what it cannot read exactly. Imports torch and transformers when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# `general.architecture` of the files read here (a llama file with experts too: see MIXTRAL)
ARCHITECTURES = ("qwen3", "qwen3moe", "qwen2moe", "gemma2", "gemma3", "phi3")
MIXTRAL = "llama"  # with `llama.expert_count`
# llama.cpp's layer counts of the Gemma 27B models, whose attention scale is 1 / sqrt(hidden /
# heads) rather than 1 / sqrt(head_dim) (src/models/gemma2.cpp, gemma3.cpp)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp's default for gemma3: five sliding layers, then a full one


def gguf_fields(gguf: Path) -> dict[str, Any]:
    """The file's metadata, {key: value}, arrays of tokens and merges left out."""
    from gguf import GGUFReader

    fields = {}
    for key, field in GGUFReader(str(gguf)).fields.items():
        if key.startswith("tokenizer.ggml.") or key.startswith("GGUF."):
            continue
        fields[key] = field.contents()
    return fields


def _f32_float(value: float) -> float:
    """A float stored as float32 (the GGUF's epsilon), as the shortest decimal of that float32:
    1e-06 rather than 9.999999974752427e-07 (the same float32, so the same arithmetic)."""
    import numpy as np

    return float(str(np.float32(value)))


def load_model(gguf: Path, arch: str, dtype: str):
    """The transformers model of `gguf` (an `arch` file of ARCHITECTURES, or a llama one with
    experts), weights in `dtype`. ValueError for what is not read exactly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = gguf_fields(gguf)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = _fix_config(config, arch, fields)
    if arch == "phi3":
        _phi3_longrope(config, gguf, fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = _tensors(gguf, arch, model, fields)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(
            f"model: {gguf.name} ({arch}): tensors not read: {missing}; unexpected: {unexpected}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model.config.dtype = getattr(torch, dtype)
    return model.to(getattr(torch, dtype)).eval()


def _fix_config(config, arch: str, fields: dict[str, Any]):
    """transformers' config of the file, corrected as the module docstring says."""
    prefix = f"{arch}."
    key = {k[len(prefix) :]: v for k, v in fields.items() if k.startswith(prefix)}
    if hasattr(config, "rms_norm_eps"):
        config.rms_norm_eps = _f32_float(config.rms_norm_eps)
    if arch in ("qwen3", "qwen3moe"):
        config.head_dim = int(key["attention.key_length"])
    if arch in _GEMMA_27B_LAYERS:
        _fix_gemma(config, arch, key)
    if arch == "phi3":
        _fix_phi3(config, key)
    if arch in ("qwen2moe", "qwen3moe"):
        config.moe_intermediate_size = int(key["expert_feed_forward_length"])
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = int(key["expert_shared_feed_forward_length"])
    if arch == MIXTRAL:
        return _mixtral_config(config, key)
    return config


def _fix_gemma(config, arch: str, key: dict[str, Any]) -> None:
    head_dim = int(key["attention.key_length"])
    if int(key["block_count"]) == _GEMMA_27B_LAYERS[arch]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = head_dim
    # NOTE: absent, llama.cpp's caps are transformers' defaults (Gemma 2: 50 and 30; Gemma 3:
    # none); 0 means none
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cap in key:
            setattr(config, cap, float(key[cap]) or None)
    if arch == "gemma3":
        _fix_gemma3_layers(config, key)


def _fix_gemma3_layers(config, key: dict[str, Any]) -> None:
    pattern = key.get("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
    layers = config.num_hidden_layers
    if isinstance(pattern, list):  # NOTE: per layer, true where sliding
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full = dict(config.rope_parameters["full_attention"])
    kind = key.get("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"model: a gemma3 GGUF with rope.scaling.type {kind!r}: not read")
        full.update(rope_type="linear", factor=float(key["rope.scaling.factor"]))
    local = dict(config.rope_parameters["sliding_attention"])
    if "rope.freq_base_swa" in key:  # NOTE: absent, llama.cpp's default is transformers': 10000
        local["rope_theta"] = float(key["rope.freq_base_swa"])
    config.rope_parameters = {"sliding_attention": local, "full_attention": full}


def _fix_phi3(config, key: dict[str, Any]) -> None:
    head_dim = config.hidden_size // config.num_attention_heads
    rope = dict(config.rope_parameters)
    rope["partial_rotary_factor"] = int(key.get("rope.dimension_count", head_dim)) / head_dim
    config.rope_parameters = rope
    config.sliding_window = int(key.get("attention.sliding_window", 0)) or None
    original = key.get("rope.scaling.original_context_length")
    if original is not None:
        config.original_max_position_embeddings = int(original)


def _phi3_longrope(config, gguf: Path, fields: dict[str, Any]) -> None:
    """A longrope rope from the file's factor tensors, if it has them; ValueError for a file
    whose attention factor is not longrope's formula (a yarn one: not read)."""
    import math

    from gguf import GGUFReader

    factors = {
        t.name: [float(x) for x in t.data]
        for t in GGUFReader(str(gguf)).tensors
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")
    }
    if not factors:
        return
    original = config.original_max_position_embeddings
    scale = config.max_position_embeddings / original
    want = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stored = fields.get("phi3.rope.scaling.attn_factor", want)
    if abs(stored - want) > 1e-6 * want:
        raise ValueError(
            f"model: {gguf.name}: phi3.rope.scaling.attn_factor {stored} is not longrope's "
            f"{want} (a yarn-scaled file?): pagedserve reads longrope phi3 files only"
        )
    config.rope_parameters = {
        **config.rope_parameters,
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "short_factor": factors["rope_factors_short.weight"],
        "long_factor": factors["rope_factors_long.weight"],
    }


def _mixtral_config(config, key: dict[str, Any]):
    from transformers import MixtralConfig

    values = config.to_dict()
    for name in ("model_type", "architectures", "transformers_version", "pretraining_tp",
                 "mlp_bias", "attention_bias", "quantization_config"):  # fmt: skip
        values.pop(name, None)
    return MixtralConfig(
        **values,
        num_local_experts=int(key["expert_count"]),
        num_experts_per_tok=int(key["expert_used_count"]),
    )


def _tensors(gguf: Path, arch: str, model, fields: dict[str, Any]) -> dict:
    """{checkpoint name: tensor} as transformers' reader dequantizes them, corrected."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if arch == MIXTRAL:
        return _mixtral_tensors(gguf, model)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    if arch == "qwen2moe":
        # NOTE: transformers adds a dimension to every shared expert gate, meant for a quantized
        # one stored 1-D: an F32 / F16 one is [1, hidden] already
        for name, t in tensors.items():
            if name.endswith("shared_expert_gate.weight"):
                tensors[name] = t.reshape(1, -1)
    return tensors


def _mixtral_tensors(gguf: Path, model) -> dict:
    """A Mixtral's tensors: the dense ones (q/k rows un-permuted) through transformers' llama
    reader, the router and experts from the file's blocks, as HF Mixtral lays them out."""
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    values = model.config.to_dict()
    for name in ("model_type", "architectures", "transformers_version"):
        values.pop(name, None)
    dense = LlamaForCausalLM(LlamaConfig(**values))
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=dense)["tensors"]
    tensors = {k: v for k, v in tensors.items() if ".mlp." not in k}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    for t in GGUFReader(str(gguf)).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2].startswith("ffn_"):
            array = dequantize(t.data, t.tensor_type)
            experts[(int(parts[1]), parts[2])] = torch.from_numpy(array.copy())
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp."
        for part in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            if (layer, part) not in experts:
                raise ValueError(
                    f"model: {gguf.name} has no blk.{layer}.{part}.weight (a file of an older "
                    "llama.cpp with one tensor per expert?): pagedserve reads stacked experts only"
                )
        tensors[prefix + "gate.weight"] = experts[(layer, "ffn_gate_inp")]
        gate_up = (experts[(layer, "ffn_gate_exps")], experts[(layer, "ffn_up_exps")])
        tensors[prefix + "experts.gate_up_proj"] = torch.cat(gate_up, dim=1)
        tensors[prefix + "experts.down_proj"] = experts[(layer, "ffn_down_exps")]
    return tensors
