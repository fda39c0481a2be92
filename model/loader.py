"""Load a Llama-family checkpoint from a local Hugging Face directory (safetensors only)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

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
    _warn_if_slow(config)
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
    loaded: set[str] = set()
    for path in safetensors_files(config.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
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


def _warn_if_slow(config: ModelConfig) -> None:
    if config.quantization is not None and config.dtype != torch.bfloat16:
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
