"""Gemma 2 and Gemma 3 (text): Llama's attention and MLP in Gemma's layer, norms and ropes.

What differs from Llama's decoder (model/llama.py), as transformers' Gemma2/Gemma3 modeling code
computes it:
- RMSNorm in float32 weighted by (1 + weight) before the cast back (`GemmaRMSNorm`), also for
  Gemma 3's per-head q/k norms;
- four norms per layer: before and after attention, before and after the MLP (each branch's
  output is normed before its residual add);
- one rope per layer type (Gemma 3: its sliding layers' at `rope_local_base_freq`, its full
  layers' at `rope_theta`, possibly scaled; `LayerRopes`).
The rest is data on `ModelConfig` that llama.py reads: the embeddings times sqrt(hidden) rounded
to the model's dtype, GeGLU (`hidden_activation`), the attention scale query_pre_attn_scalar**-0.5,
per-layer sliding windows, the final-logit soft-cap.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.model.config import ModelConfig
from pagedserve.model.llama import (
    MLP,
    Attention,
    DecoderStack,
    LlamaForCausalLM,
    RMSNorm,
    RopeTables,
    RotaryEmbedding,
)


class GemmaRMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) * (offset + weight), all in float32, then the cast back
    (transformers' Gemma2RMSNorm / Gemma3RMSNorm, offset 1)."""

    def __init__(self, size: int, eps: float, offset: float) -> None:
        super().__init__(size, eps)
        self.offset = offset

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype), x


def gemma_norm(config: ModelConfig, size: int) -> RMSNorm:
    """Gemma's RMSNorm over `size` features."""
    return GemmaRMSNorm(size, config.rms_norm_eps, config.norm_offset)


class GemmaDecoderLayer(nn.Module):
    """h = x + norm2(attn(norm1(x)));  out = h + norm4(mlp(norm3(h)))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, norm=gemma_norm)
        self.mlp = MLP(config)
        size = config.hidden_size
        self.input_layernorm = gemma_norm(config, size)
        self.post_attention_layernorm = gemma_norm(config, size)
        self.pre_feedforward_layernorm = gemma_norm(config, size)
        self.post_feedforward_layernorm = gemma_norm(config, size)
        # which of `LayerRopes.at`'s tables this layer rotates with
        self.rope_index = LayerRopes.names(config).index(_rope_name(config, layer_idx))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: tuple[RopeTables, ...],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`DecoderLayer.forward`'s contract: (the normed MLP output, the stream it is added to);
        `residual` is None for the first layer."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, ropes[self.rope_index], kv_cache, meta)
        h, residual = self.pre_feedforward_layernorm.add_norm(
            self.post_attention_layernorm(h), residual
        )
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def gemma_stack(config: ModelConfig) -> DecoderStack:
    """`model.*` in the checkpoints: embeddings, Gemma's layers, Gemma's final norm."""
    return DecoderStack(config, GemmaDecoderLayer, gemma_norm)


def _rope_name(config: ModelConfig, layer_idx: int) -> str:
    return config.layer_ropes[layer_idx] if config.layer_ropes else ""


class LayerRopes:
    """One `RotaryEmbedding` per rope the layers use: Gemma 3's per layer type
    (`ModelConfig.layer_ropes`), Gemma 2's one."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.tables = [RotaryEmbedding(config, device, name or None) for name in self.names(config)]

    @staticmethod
    def names(config: ModelConfig) -> list[str]:
        """The ropes' names in `rope_parameters`, sorted; [""] for a model with one rope."""
        return sorted(set(config.layer_ropes)) or [""]

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[RopeTables, ...]:
        """Each rope's cos and sin for `positions`, in `names` order."""
        return tuple(rope.at(positions, dtype) for rope in self.tables)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2's and Gemma 3's text model. Its layers never take the native decode stack
    (model/native_stack.py declines them)."""

    stack = staticmethod(gemma_stack)

    def __init__(self, config: ModelConfig, ropes: LayerRopes) -> None:
        super().__init__(config, ropes.tables[0])
        self.ropes = ropes

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`LlamaForCausalLM.forward`'s contract; each layer rotates with its own rope."""
        x, residual = self._embed(input_ids), None
        ropes = self.ropes.at(positions, x.dtype)
        for layer in self.model.layers:
            x, residual = layer(x, residual, ropes, kv_cache, meta)
        return self.model.norm.add_norm(x, residual)[0]
