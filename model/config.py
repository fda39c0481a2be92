"""What pagedserve needs to know about a checkpoint, read from a local Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.generation_config import eos_token_ids, read_generation_config
from pagedserve.kvstore.hashing import model_fingerprint
from pagedserve.kvstore.kv_cache import kv_cache_dtype as kv_cache_dtype_from_name
from pagedserve.model import phi3
from pagedserve.model.activations import activation
from pagedserve.model.family_defaults import (
    DEFAULT_ROPE_THETA,
    DEFAULT_THETAS,
    DEFAULTS,
    GEMMA3_THETAS,
)
from pagedserve.model.moe_config import MOE_ARCHITECTURES, moe_fields
from pagedserve.model.quant import WeightQuant

if TYPE_CHECKING:
    from pagedserve.model.tensor_parallel import Shard

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# NOTE: Qwen2 and Qwen3 configs share their sliding-window rules (Qwen2Config.__post_init__)
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# NOTE: named in the refusal: a multimodal checkpoint whose text model pagedserve would run
_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM (model_type gemma3_text)"}
# NOTE: transformers recomputes the frequencies of `dynamic` and `longrope` in each forward from
# the longest position in it (beyond max_position_embeddings, resp. the original one), so a token's
# rotation depends on its batch and the keys already cached; pagedserve's rope tables are fixed,
# so both are refused rather than served approximately.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# NOTE: Phi3Config accepts only these; `longrope` is served while every position stays within
# original_max_position_embeddings (`model_len`), where transformers always uses short_factor
PHI3_ROPE_TYPES = ("default", "longrope")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-family decoder, normalised across Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite,
    Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen2-MoE and Qwen3-MoE configs. The fields with defaults
    after `raw` are the family variants; their defaults are Llama's layer."""

    model_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # RMSNorms of q and k before rope: "" none; "head" over each head (Qwen3); "projection" over
    # the whole q and k projections, every head at once (OLMo 2)
    qk_norm: str
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    rope_type: str
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's, then generation_config.json's
    raw: dict[str, Any]  # config.json as written, for the fingerprint and the rope functions
    quantization: WeightQuant | None = None  # the linear layers' weights (model/quant.py)
    kv_cache_dtype: torch.dtype | None = None  # stored KV elements; None = `dtype` (kv_cache.py)
    tp: Shard | None = None  # one tensor-parallel rank's part of the model (tensor_parallel.py)
    # OLMo 2: norms after attention and MLP, on the residual branch (`post_attention_layernorm`,
    # `post_feedforward_layernorm`), none before
    post_norms: bool = False
    # OLMo 2: norms apply their weight, and rope rotates, in float32 before the cast back
    late_casts: bool = False
    embedding_multiplier: float = 1.0  # Granite: the embeddings scaled
    residual_multiplier: float = 1.0  # Granite: each residual branch scaled before its add
    attention_multiplier: float | None = None  # Granite: the attention's scale; None: D**-0.5
    logits_scaling: float = 1.0  # Granite: the logits divided by it
    # Phi-3 (`partial_rotary_factor`): rope rotates the first `rotary_dim` of each head's dims,
    # the rest pass through; None: all of head_dim
    rotary_dim: int | None = None
    # longrope (Phi-3): the context past which transformers switches to long_factor
    original_max_position_embeddings: int | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; model/moe.py): the MLP of the layers
    # `sparse_layers` marks is a router over `num_experts` SwiGLU experts of
    # `moe_intermediate_size` features, `experts_per_token` of them per token
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    sparse_layers: tuple[bool, ...] = ()  # per layer: its MLP is the MoE block; (): none is
    # Mixtral: the top-k weights scale the experts' outputs in float32 (Qwen: in the model dtype)
    float32_routing_weights: bool = False
    # Gemma: the embedding multiplier rounded to the model's dtype before it multiplies
    # (transformers' Gemma multiplies by a tensor of that dtype; Granite by a Python float)
    embedding_multiplier_in_dtype: bool = False
    # Gemma: RMSNorms weighted by (norm_offset + weight) in float32, then the cast back
    norm_offset: float = 0.0
    # Gemma: four norms per layer, before and after attention and before and after the MLP
    sandwich_norms: bool = False
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2 (Gemma 3 optional): the same on logits
    # Gemma 3: each layer's rope, by its name in `rope_parameters` ("sliding_attention" or
    # "full_attention"); () = one rope for every layer
    layer_ropes: tuple[str, ...] = ()

    @property
    def rope_dim(self) -> int:
        """The dims of each head rope rotates (its tables' width)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def is_moe(self) -> bool:
        """Some layer's MLP is a mixture of experts."""
        return any(self.sparse_layers)

    @property
    def attention_scale(self) -> float:
        """q.k's factor before the softmax: Granite's `attention_multiplier`, else D**-0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim**-0.5

    def fingerprint(self, revision: str = "") -> bytes:
        """The block-hash fingerprint of the KV this model produces (docs/hashing.md): its
        config, dtype, `revision` and weight quantization. Prefill and decode workers both use
        this, so their block hashes and layout compat hashes agree."""
        weights = self.quantization.name if self.quantization is not None else ""
        return model_fingerprint(
            self.raw, dtype=dtype_name(self.dtype), revision=revision, weights=weights
        )


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` -> torch.bfloat16; ValueError naming `dtype` otherwise."""
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_model_config(
    model_dir: str | Path,
    dtype: str | None = None,
    quantization: WeightQuant | None = None,
    kv_cache_dtype: str | None = None,
) -> ModelConfig:
    """Read `model_dir/config.json`; `dtype` (e.g. "bfloat16") overrides the checkpoint's;
    `quantization` stores the linear layers' weights in int8 or int4 (model/quant.py);
    `kv_cache_dtype` ("auto", "int8", "fp8_e4m3") the KV cache's elements (kvstore/kv_cache.py).

    Raises FileNotFoundError for a missing directory or config.json and ValueError for an
    architecture, rope type or dtype pagedserve does not run.
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir} (expected a local HF dir)")
    raw = json.loads(path.read_text())
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        text = (
            f" (only its text model is served: {_TEXT_MODELS[arch]})"
            if arch in _TEXT_MODELS
            else ""
        )
        raise ValueError(
            f"model: architecture {arch!r} (config.json `architectures`) is not supported{text}; "
            f"pagedserve runs {', '.join(SUPPORTED_ARCHITECTURES)} (docs/models.md)"
        )
    if arch == phi3.ARCHITECTURE and quantization is not None:
        raise ValueError(f"--quantization {quantization.method}: not tested for {arch}; omit it")
    if quantization is not None and arch in MOE_ARCHITECTURES:
        raise ValueError(
            f"--quantization {quantization.name}: {arch} (a mixture of experts) is served "
            "unquantized only (its experts are not quantized layers; docs/models.md)"
        )
    hf = _hf_config(model_dir, raw, arch)
    layer_ropes = tuple(hf.layer_types) if arch == "Gemma3ForCausalLM" else ()
    rope_types = PHI3_ROPE_TYPES if arch == "Phi3ForCausalLM" else SUPPORTED_ROPE_TYPES
    rope_type = _rope_type(hf, layer_ropes, rope_types)
    hidden_act = hf.hidden_activation if arch in GEMMA else hf.hidden_act
    activation(hidden_act)  # NOTE: refused here, at load, not at the first forward
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"model: {num_heads} heads not divisible by {num_kv_heads} kv heads")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    qkv_bias, o_bias, mlp_bias = _biases(arch, hf)
    checkpoint_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    model_dtype = dtype_from_name(dtype or checkpoint_dtype)
    stored = kv_cache_dtype_from_name(kv_cache_dtype, model_dtype)
    # NOTE: a chat model often ends its turn with an eos id only generation_config.json names
    eos_ids = eos_token_ids({"eos_token_id": hf.eos_token_id}, read_generation_config(model_dir))
    return ModelConfig(
        model_dir=model_dir,
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        hidden_act=hidden_act,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=_QK_NORMS.get(arch, ""),
        sliding_windows=_sliding_windows(arch, hf),
        rope_type=rope_type,
        dtype=model_dtype,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids,
        raw=raw,
        quantization=quantization,
        kv_cache_dtype=None if stored == model_dtype else stored,
        post_norms=arch == "Olmo2ForCausalLM",
        late_casts=arch == "Olmo2ForCausalLM",
        **_multipliers(arch, hf),
        **phi3.rope_fields(arch, hf, head_dim, rope_type),
        **moe_fields(arch, hf),
        **_gemma(arch, hf, layer_ropes),
    )


def _rope_type(hf: Any, layer_ropes: tuple[str, ...], supported: tuple[str, ...]) -> str:
    """The rope type (Gemma 3: the full-attention layers'); ValueError for one pagedserve does
    not run (not in `supported`), in any layer's rope."""
    params = hf.rope_parameters or {}
    types = [(params.get(name) or {}).get("rope_type", "default") for name in set(layer_ropes)]
    rope_type = (params["full_attention"] if layer_ropes else params).get("rope_type", "default")
    for name in [rope_type, *types]:
        if name not in supported:
            raise ValueError(
                f"model: rope_scaling.rope_type {name!r} (config.json) is not supported; "
                f"pagedserve runs {', '.join(supported)} (docs/models.md)"
            )
    return rope_type


_QK_NORMS = {
    "Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "Olmo2ForCausalLM": "projection",
    "Gemma3ForCausalLM": "head",
}  # fmt: skip


def _multipliers(arch: str, hf: Any) -> dict[str, Any]:
    if arch != "GraniteForCausalLM":
        return {}
    return {
        "embedding_multiplier": float(hf.embedding_multiplier),
        "residual_multiplier": float(hf.residual_multiplier),
        # NOTE: GraniteConfig's default is 1.0, not head_dim**-0.5
        "attention_multiplier": float(hf.attention_multiplier),
        "logits_scaling": float(hf.logits_scaling),
    }


def _gemma(arch: str, hf: Any, layer_ropes: tuple[str, ...]) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's fields; ValueError naming a config field it does not serve
    exactly."""
    if arch not in GEMMA:
        return {}
    if getattr(hf, "use_bidirectional_attention", None):
        raise ValueError("model: use_bidirectional_attention true (config.json) is not supported")
    attn_softcap = hf.attn_logit_softcapping
    if attn_softcap is not None and arch == "Gemma3ForCausalLM":
        # NOTE: transformers 5.25's Gemma 3 attention never applies it (its forward does not
        # pass it on to the attention function): refused rather than guessed either way
        raise ValueError(
            f"model: attn_logit_softcapping {attn_softcap} (config.json) is not supported for "
            f"{arch}; pagedserve runs null only"
        )
    return {
        "embedding_multiplier": hf.hidden_size**0.5,
        "embedding_multiplier_in_dtype": True,
        "attention_multiplier": hf.query_pre_attn_scalar**-0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "attn_logit_softcap": attn_softcap,
        "final_logit_softcap": hf.final_logit_softcapping,
        "layer_ropes": layer_ropes,
    }


_PLAIN_ROPE_KEYS = {"rope_type", "type", "rope_theta"}


def _hf_config(model_dir: Path, raw: dict[str, Any], arch: str) -> Any:
    """config.json as transformers' config class of `arch` reads it (attributes, defaults filled).

    A config with plain rope (the common case) is read here; one with scaled rope or anything
    else this reader does not normalise goes through transformers' AutoConfig (which normalises
    rope parameters across its versions, and whose import costs a worker ~2 s of start-up).
    """
    rope = _plain_rope(raw)
    if rope is not None and arch == "Gemma3ForCausalLM":
        rope = _gemma3_ropes(raw)
    if rope is None or arch not in DEFAULTS:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    theta = DEFAULT_THETAS.get(arch, DEFAULT_ROPE_THETA)  # NOTE: the config class's
    ropes = rope if arch == "Gemma3ForCausalLM" else {"rope_theta": theta, **rope}
    fields = {**DEFAULTS[arch], **raw, "rope_parameters": ropes}
    if "num_experts" in raw and "num_local_experts" in fields:  # NOTE: their attribute_map
        fields["num_local_experts"] = raw["num_experts"]
    _post_init(arch, raw, fields)
    return SimpleNamespace(**fields)


def _post_init(arch: str, raw: dict[str, Any], fields: dict[str, Any]) -> None:
    """What the config class of `arch` derives in its `__post_init__`, step for step (the
    windows and layer types), on `fields` in place."""
    if arch in GEMMA and fields["layer_types"] is None:
        # NOTE: Gemma2Config.__post_init__ (every other layer windowed) and Gemma3TextConfig's
        # (every `sliding_window_pattern`-th layer full)
        pattern = 2 if arch == "Gemma2ForCausalLM" else raw.get("sliding_window_pattern", 6)
        fields["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(fields["num_hidden_layers"])
        ]
    elif arch in _QWEN:  # NOTE: Qwen2Config.__post_init__ (Qwen3Config's too), step for step
        if not fields["use_sliding_window"]:
            fields["sliding_window"] = None
        if fields["layer_types"] is None:
            fields["layer_types"] = [
                "sliding_attention"
                if fields["sliding_window"] is not None and i >= fields["max_window_layers"]
                else "full_attention"
                for i in range(fields["num_hidden_layers"])
            ]
    elif arch == "Qwen3MoeForCausalLM" and not fields["use_sliding_window"]:
        fields["sliding_window"] = None  # NOTE: Qwen3MoeConfig.__post_init__
    elif arch == "Qwen2MoeForCausalLM":  # NOTE: Qwen2MoeConfig.__post_init__, step for step
        if not fields["use_sliding_window"]:
            fields["sliding_window"] = 0
        if fields["layer_types"] is None:
            fields["layer_types"] = [
                "sliding_attention"
                if (i + 1) % 2 and i < fields["max_window_layers"] and fields["use_sliding_window"]
                else "full_attention"
                for i in range(fields["num_hidden_layers"])
            ]


def _plain_rope(raw: dict[str, Any]) -> dict[str, Any] | None:
    """`{"rope_type": "default", "rope_theta": ...}` when config.json asks for plain rope (in any
    of the spellings transformers accepts; without "rope_theta" where it names none); None for
    anything else."""
    if "partial_rotary_factor" in raw:
        return None
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= _PLAIN_ROPE_KEYS:
        return None
    if params.get("rope_type", params.get("type", "default")) != "default":
        return None
    theta = params.get("rope_theta", raw.get("rope_theta"))
    return (
        {"rope_type": "default"} if theta is None else {"rope_type": "default", "rope_theta": theta}
    )


def _gemma3_ropes(raw: dict[str, Any]) -> dict[str, Any] | None:
    """Gemma3TextConfig's `rope_parameters` for a config.json without scaled rope: the full
    attention layers' at `rope_theta`, the sliding ones' at `rope_local_base_freq`; None for
    any other (read by transformers)."""
    if raw.get("rope_scaling") or raw.get("rope_parameters"):
        return None
    full, local = GEMMA3_THETAS
    return {
        "sliding_attention": {
            "rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", local),
        },
        "full_attention": {"rope_type": "default", "rope_theta": raw.get("rope_theta", full)},
    }  # fmt: skip


def _biases(arch: str, hf: Any) -> tuple[bool, bool, bool]:
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    # NOTE: o follows attention_bias
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Olmo2ForCausalLM", *GEMMA):
        attention_bias = bool(getattr(hf, "attention_bias", False))  # ... and no MLP bias
        return attention_bias, attention_bias, False
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return False, False, False
    if arch == "Qwen2MoeForCausalLM":
        return bool(hf.qkv_bias), False, False
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return attention_bias, attention_bias, bool(getattr(hf, "mlp_bias", False))


def _sliding_windows(arch: str, hf: Any) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    # NOTE: one window on every layer
    if arch in (
        "MistralForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    ):
        return (window,) * hf.num_hidden_layers
    if arch == "Qwen2MoeForCausalLM" and "sliding_attention" in hf.layer_types and not window:
        raise ValueError(
            "model: layer_types names sliding_attention layers but use_sliding_window is false "
            "(config.json; Qwen2-MoE's window is then 0)"
        )
    if arch in (*_QWEN, "Qwen2MoeForCausalLM", *GEMMA):
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * hf.num_hidden_layers


def rope_frequencies(
    config: ModelConfig, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim // 2] float32, attention_scaling) for the checkpoint's rope, or for
    the rope of the layers `layer_type` names (Gemma 3's `rope_parameters` per layer type).

    Uses transformers' own rope initialisers, so scaled ropes (linear, llama3, yarn; longrope's
    short factors, as `model_len` allows it) agree with the oracle bit for bit.
    """
    hf = _hf_config(config.model_dir, config.raw, config.architecture)
    params = hf.rope_parameters if layer_type is None else hf.rope_parameters[layer_type]
    rope_type = config.rope_type if layer_type is None else params.get("rope_type", "default")
    if rope_type == "default":
        base, dim = params["rope_theta"], config.rope_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (base**exponents), 1.0
    # NOTE: imported here, for scaled ropes only: transformers costs a worker ~2 s of start-up
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = (
        init(hf, "cpu") if layer_type is None else init(hf, "cpu", layer_type=layer_type)
    )
    return inv_freq.float(), float(scaling)


def model_len(config: ModelConfig, max_model_len: int | None) -> int:
    """The longest prompt + output an engine serves: `max_model_len` (a worker's
    `--max-model-len`), else the model's max_position_embeddings. ValueError past the latter:
    the rope tables end there (model/llama.py), and a longer position would fail mid-request;
    for longrope, ValueError past original_max_position_embeddings (model/phi3.py)."""
    limit = config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{limit} (its rope tables end there)"
        )
    served = max_model_len or limit
    phi3.check_longrope_len(config.rope_type, config.original_max_position_embeddings, served)
    return served
