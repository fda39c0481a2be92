"""Load a Llama-family checkpoint from a local Hugging Face directory (safetensors only)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.model import gguf_weights
from pagedserve.model.config import ModelConfig
from pagedserve.model.llama import LlamaForCausalLM, RotaryEmbedding
from pagedserve.model.quant import QuantizedLinear, quantize_linears

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
    rope = RotaryEmbedding(config, device)  # computed, never loaded
    with torch.device("meta"):
        model = LlamaForCausalLM(config, rope)
        if config.quantization is not None:
            quantize_linears(model, config.quantization)
    model.to_empty(device=device).to(config.dtype)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    # NOTE: a quantized layer's weight is quantized as it is read, never held in full
    quantized = {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    loaded = _load_gguf_blocks(config, quantized)
    for path in safetensors_files(config.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                tied = name == "lm_head.weight" and config.tie_word_embeddings
                if tied or name in loaded:  # NOTE: `loaded`: from the GGUF's 4-bit blocks
                    continue
                if name in quantized:
                    try:
                        quantized[name].load_weight(f.get_tensor(name))
                    except ValueError as exc:
                        raise ValueError(f"model: {name}: {exc}") from None
                elif name in params:
                    _copy_param(params[name], f.get_tensor(name), name, config.dtype)
                else:
                    raise ValueError(f"model: unexpected tensor {name!r} in {path.name}")
                loaded.add(name)
    model.tie_weights()
    expected = {n for n in params if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    expected |= set(quantized)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"model: tensors missing from the checkpoint: {missing[:8]}")
    return model.eval()


def _load_gguf_blocks(config: ModelConfig, quantized: dict[str, QuantizedLinear]) -> set[str]:
    """With int4 weights in groups of 32, the decoder linears a converted GGUF holds as Q4_0 /
    Q4_1, taken from its blocks as they are (model/gguf_weights.py). Their names."""
    quant = config.quantization
    if quant is None or quant.method != "int4" or quant.group_size != gguf_weights.GROUP:
        return set()
    gguf = gguf_weights.gguf_source(config.model_dir)
    if gguf is None:
        return set()
    loaded: set[str] = set()
    for name, (codes, scale, zero) in gguf_weights.q4_linears(
        gguf, config.num_heads, config.num_kv_heads
    ):
        if name in quantized:
            quantized[name].load_int4(codes, scale, zero)
            loaded.add(name)
    logger.info("%d linear layers read from %s's 4-bit blocks", len(loaded), gguf.name)
    return loaded


def _warn_if_slow(config: ModelConfig, device: torch.device) -> None:
    # NOTE: on CUDA every dtype takes the Triton kernels (kernels/triton_quant.py)
    if config.quantization is not None and config.dtype != torch.bfloat16 and device.type == "cpu":
        logger.warning(
            "quantization %s with %s activations multiplies by the dequantized weights (a "
            "memory saving, slower than unquantized); --dtype bfloat16 uses the packed kernels "
            "(docs/quantization.md)", config.quantization.name, config.dtype,
        )  # fmt: skip


def _copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"model: {name} has shape {tuple(tensor.shape)}, want {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(dtype))
