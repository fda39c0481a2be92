"""Load a Llama-family checkpoint from a local Hugging Face directory (safetensors only)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.kernels import cpu_native
from pagedserve.kernels.cpu_native import has_bf16_arithmetic
from pagedserve.model import gguf_weights, moe, phi3
from pagedserve.model.config import ModelConfig
from pagedserve.model.gemma import GemmaForCausalLM, LayerRopes
from pagedserve.model.llama import Linear, LlamaForCausalLM, RotaryEmbedding
from pagedserve.model.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    WeightQuant,
    quantize_head,
)

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights of ours (old exports saved rope buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: from model.safetensors.index.json if present, else *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"model: shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors in {model_dir} (.bin is not supported)")
    return files


def load_model(config: ModelConfig, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Build the model on `device` in `config.dtype` and fill every parameter from the checkpoint.

    Raises FileNotFoundError for missing files and ValueError naming any missing or mis-shaped
    tensor; nothing is left randomly initialised.
    """
    _warn_if_slow(config, torch.device(device))
    build = _builder(config, device)
    with torch.device("meta"):
        model = build()
        if config.quantization is not None:
            quantize_linears(model, config.quantization)
    _materialize(model, torch.device(device), config.dtype)
    model.fuse_projections()  # NOTE: before loading: the checkpoint fills the fused slices
    blocks = _gguf_blocks(config)
    if blocks is not None:
        _quantized_embedding(model, config, blocks[1], device)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    # NOTE: a quantized layer's weight is quantized as it is read, never held in full
    quantized = {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    loaded = _load_gguf_blocks(config, model, quantized, blocks)
    _load_safetensors(config, params, quantized, loaded)
    model.tie_weights()
    expected = {n for n in [*quantized, *(blocks[1] if blocks else ())]}
    expected.update(key for name, param in params.items() for key in moe.part_keys(name, param))
    expected -= {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"model: tensors missing from the checkpoint: {missing[:8]}")
    quant = config.quantization
    # NOTE: a GGUF's Q8_0 head is int8 already
    if quant is not None and quant.lm_head and type(model.lm_head) is Linear:
        head_method = quant.method if quant.int8_codes else "int8"
        model.lm_head = quantize_head(model.lm_head, head_method)  # type: ignore[assignment]
    return model.eval()


def _builder(config: ModelConfig, device: torch.device | str) -> Callable[[], LlamaForCausalLM]:
    """The family's model constructor, its rope tables computed (never loaded) on `device`."""
    if config.sandwich_norms:  # Gemma 2, Gemma 3
        ropes = LayerRopes(config, device)
        return lambda: GemmaForCausalLM(config, ropes)
    rope = RotaryEmbedding(config, device)
    return lambda: LlamaForCausalLM(config, rope)


def quantize_linears(model: LlamaForCausalLM, quant: WeightQuant) -> None:
    """Replace every `Linear` of the decoder layers (q/k/v/o, gate/up/down) by a
    `QuantizedLinear` of the same shape; the embedding and the LM head stay as they are. Call
    on a model built on the meta device, before its weights are loaded."""
    for layer in model.model.layers:
        for parent in layer.children():  # self_attn, mlp (the norms have no children)
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    q = QuantizedLinear(
                        child.in_features, child.out_features, child.bias is not None, quant
                    )
                    setattr(parent, name, q)


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`model.to_empty(device=device).to(dtype)` for a model built on the meta device: empty
    storage, floating tensors in `dtype`, the others in their own dtype.

    NOTE: `to_empty` goes through torch's reference `empty_like`, whose first call imports
    sympy (~0.5 s of a worker's start-up); `torch.empty` does not.
    """
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=_cast(param.dtype, dtype), device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty(
                buffer.shape, dtype=_cast(buffer.dtype, dtype), device=device
            )


def _cast(own: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if own.is_floating_point else own


def _load_safetensors(
    config: ModelConfig,
    params: dict[str, torch.Tensor],
    quantized: dict[str, QuantizedLinear],
    loaded: set[str],
) -> None:
    """Every tensor of the checkpoint not yet `loaded` (from a GGUF's blocks) into `params` or
    `quantized`; their names added to `loaded`."""
    row_sizes = phi3.fused_row_sizes(
        config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    )
    for path in safetensors_files(config.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_IGNORED_SUFFIXES) or name in loaded:
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                tensor = f.get_tensor(name)
                # NOTE: tensor parallelism is refused for MoE: no rank's part to cut first
                if config.is_moe and _load_moe(name, tensor, params, config.dtype, loaded):
                    continue
                # NOTE: Phi-3's fused qkv_proj / gate_up_proj come as our q/k/v, gate/up rows
                for part, piece in phi3.split_fused(name, tensor, row_sizes):
                    _load_tensor(config, params, quantized, part, piece, path)
                    loaded.add(part)


def _load_tensor(
    config: ModelConfig,
    params: dict[str, torch.Tensor],
    quantized: dict[str, QuantizedLinear],
    name: str,
    tensor: torch.Tensor,
    path: Path,
) -> None:
    """One checkpoint tensor into the parameter (or quantized layer) of its name."""
    if config.tp is not None:  # NOTE: one tensor-parallel rank's part of it
        tensor = config.tp.tensor(name, tensor)
    if name in quantized:
        try:
            quantized[name].load_weight(tensor)
        except ValueError as exc:
            raise ValueError(f"model: {name}: {exc}") from None
    elif name in params:
        _copy_param(params[name], tensor, name, config.dtype)
    else:
        raise ValueError(f"model: unexpected tensor {name!r} in {path.name}")


def _load_moe(
    name: str,
    tensor: torch.Tensor,
    params: dict[str, torch.Tensor],
    dtype: torch.dtype,
    loaded: set[str],
) -> bool:
    """Load checkpoint tensor `name` of a mixture of experts where its name is not the module's:
    Mixtral's `block_sparse_moe.*`, one expert's gate, up or down weight (into its slice of the
    stacked experts, model/moe.py), or a whole stack. False, doing nothing, for other names."""
    own = moe.checkpoint_name(name)
    part = moe.expert_part(own, params)
    if part is not None:
        key, target = part
        _copy_param(target, tensor, name, dtype)
        loaded.add(key)
        return True
    if own not in params or (own == name and not own.endswith(moe.STACKED)):
        return False  # NOTE: a tensor of the module's own name, loaded as any other
    _copy_param(params[own], tensor, name, dtype)
    loaded.update(moe.part_keys(own, params[own]))
    return True


def _gguf_blocks(config: ModelConfig) -> tuple[Path, dict[str, str]] | None:
    """(the GGUF a converted model came from, {checkpoint name: GGUF type} of the tensors to
    read from its blocks), when its weights are quantized (model/gguf_weights.py)."""
    method = gguf_weights.block_method(config.quantization)
    gguf = gguf_weights.gguf_source(config.model_dir) if method else None
    if gguf is None or method is None or config.tp is not None:
        # NOTE: a tensor-parallel rank quantizes its part of the safetensors (no sharded blocks)
        return None
    return gguf, gguf_weights.block_kinds(gguf, method)


def _quantized_embedding(
    model: LlamaForCausalLM, config: ModelConfig, kinds: dict[str, str], device: torch.device | str
) -> None:
    """Give the model int8 tables where the GGUF stores its embedding (and untied head) as
    Q8_0; a tied head then computes over the embedding's codes."""
    hidden, vocab = config.hidden_size, config.vocab_size
    with torch.device(device):
        if gguf_weights.EMBEDDING in kinds:
            table = QuantizedEmbedding(vocab, hidden, gguf_weights.GROUP, config.dtype)
            model.model.embed_tokens = table  # type: ignore[assignment]
            if config.tie_word_embeddings:
                model.lm_head = table.head()  # type: ignore[assignment]
        if gguf_weights.HEAD in kinds and not config.tie_word_embeddings:
            head = QuantizedLinear(hidden, vocab, False, WeightQuant("int8"))
            head.scales = torch.empty(vocab, hidden // gguf_weights.GROUP)
            model.lm_head = head  # type: ignore[assignment]


def _load_gguf_blocks(
    config: ModelConfig,
    model: LlamaForCausalLM,
    quantized: dict[str, QuantizedLinear],
    blocks: tuple[Path, dict[str, str]] | None,
) -> set[str]:
    """The tensors `_gguf_blocks` names, taken from the file's blocks as they are. Their names."""
    if blocks is None:
        return set()
    gguf, kinds = blocks
    method = gguf_weights.block_method(config.quantization)
    assert method is not None
    loaded: set[str] = set()
    for name, payload in gguf_weights.quantized_tensors(
        gguf, method, config.num_heads, config.num_kv_heads
    ):
        if name == gguf_weights.EMBEDDING:
            embed = model.model.embed_tokens
            assert isinstance(embed, QuantizedEmbedding)
            embed.load(*payload)
        elif name == gguf_weights.HEAD:
            if config.tie_word_embeddings:
                continue  # NOTE: the tied head is the embedding's table
            head = model.lm_head
            assert isinstance(head, QuantizedLinear)
            head.load_int8_groups(*payload)
        elif name in quantized:
            if len(payload) == 3:
                quantized[name].load_int4(*payload)
            else:
                quantized[name].load_int8_groups(*payload)
        else:
            continue
        loaded.add(name)
    kinds_read = sorted({kinds[n] for n in loaded})
    logger.info("%d tensors read from %s's %s blocks", len(loaded), gguf.name, "/".join(kinds_read))
    return loaded


def _warn_if_slow(config: ModelConfig, device: torch.device) -> None:
    if config.dtype == torch.bfloat16 and device.type == "cpu" and not has_bf16_arithmetic():
        logger.warning(
            "bfloat16 on a CPU without AVX512-BF16 or AMX: torch emulates its matmuls, and "
            "float32 (--dtype float32) is faster here, about 3x for SmolLM2 on an AVX2 EPYC "
            "(docs/kernels.md)"
        )
    w8a8 = config.quantization is not None and config.quantization.method == "w8a8"
    if w8a8 and (device.type != "cpu" or config.dtype != torch.float32):
        raise ValueError(
            "quantization: w8a8 runs on CPU with float32 activations (--dtype float32); "
            f"here {device.type} and {str(config.dtype).removeprefix('torch.')}"
        )
    # NOTE: on CUDA every dtype takes the Triton kernels (kernels/triton_quant.py)
    quantized_fp = config.quantization is not None and config.dtype != torch.bfloat16
    why_not = cpu_native.unavailable_reason() if quantized_fp and device.type == "cpu" else None
    if why_not is not None:
        assert config.quantization is not None
        logger.warning(
            "quantization %s with %s activations without the native CPU kernels (%s) multiplies "
            "by the dequantized weights (a memory saving, slower than unquantized); --dtype "
            "bfloat16 uses the packed kernels (docs/quantization.md)",
            config.quantization.name, config.dtype, why_not,
        )  # fmt: skip


def _copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"model: {name} has shape {tuple(tensor.shape)}, want {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(dtype))
