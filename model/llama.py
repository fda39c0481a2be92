"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, Phi-3; Gemma's layer,
norms and ropes are model/gemma.py's; the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, whose
sparse MLPs are model/moe.py's) over a paged KV cache.

One forward takes a flattened batch: the prefill chunks and decode tokens of many sequences laid
end to end, with positions and an `AttentionMetadata` that maps them onto the cache. Module and
parameter names follow the Hugging Face checkpoints, so weights load by name.

NOTE: the arithmetic mirrors transformers' modeling code operation for operation (RMSNorm in
float32 then cast, rope cos/sin in float32 then cast, separate q/k/v projections), so that fp32
logits agree to ~1e-6 and bf16 greedy tokens agree exactly. A family's own parts are data on
`ModelConfig` and small optional parts of the layer: q/k norms (Qwen3 per head, OLMo 2 over the
projection), OLMo 2's post-norm layer (`PostNormDecoderLayer`) and float32 casts (`LateCastRMSNorm`,
rope), Granite's multipliers (embeddings, residual branches, attention scale, logits), Phi-3's
partial rotary (`rotate`; its fused checkpoint weights are the loader's, model/phi3.py), Gemma's
embedding multiplier and final-logit soft-capping.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

from pagedserve.kernels import cpu_layer_ops, cpu_linear, cpu_native, dispatch
from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.model.activations import activation
from pagedserve.model.config import ModelConfig, rope_frequencies
from pagedserve.model.native_stack import NativeStack
from pagedserve.model.tensor_parallel import Group


class Embedding(nn.Embedding):
    """`nn.Embedding` whose random init is skipped on the meta device, where the loader builds
    the model before it fills every weight. NOTE: torch's `normal_` on meta tensors imports
    torch._dynamo, about 1.5 s of a worker's start-up, for values nobody reads."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed by `cpu_linear.linear`:
    faster on CPU in fp32 for decode-sized batches, unchanged everywhere else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias)


def fuse_rows(parent: nn.Module, names: tuple[str, ...]) -> bool:
    """Give the `Linear`s `names` of `parent` one weight (and bias): theirs become row slices of
    it, so that one call reads all of them (a decode step's cost is reading the weights). The
    fused tensors are the buffers `fused_weight` / `fused_bias` (not saved); nothing is copied:
    call it on an empty model, before its weights are loaded into the slices.

    False, changing nothing, unless all of them are plain `Linear`s (a quantized layer keeps
    its own)."""
    linears = [getattr(parent, name) for name in names]
    if not all(type(linear) is Linear for linear in linears):
        return False
    for attr in ("weight", "bias"):
        parts = [getattr(linear, attr) for linear in linears]
        if any(part is None for part in parts):
            parent.register_buffer(f"fused_{attr}", None, persistent=False)
            continue
        first = parts[0]
        fused = torch.empty((sum(p.shape[0] for p in parts), *first.shape[1:]),
                            dtype=first.dtype, device=first.device)  # fmt: skip
        start = 0
        for linear, part in zip(linears, parts, strict=True):
            stop = start + part.shape[0]
            setattr(linear, attr, nn.Parameter(fused[start:stop], requires_grad=False))
            start = stop
        parent.register_buffer(f"fused_{attr}", fused, persistent=False)
    return True


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x, None)[0]

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of s, s) for s = x + residual (x alone without one): a decoder layer's
        residual add and the norm after it, in one native call for fp32 on CPU."""
        native = cpu_native.rms_norm(x, self.weight, self.eps, residual)
        if native is not None:
            return native
        if residual is not None:
            x = x + residual
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype), x


class LateCastRMSNorm(RMSNorm):
    """OLMo 2's RMSNorm: the weight multiplies the float32 normalised values, then the cast back
    (Llama's casts first). The same in float32, where the native kernel computes it."""

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return super().add_norm(x, residual)
        if residual is not None:
            x = x + residual
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype), x


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    """The family's RMSNorm over `size` features."""
    kind = LateCastRMSNorm if config.late_casts else RMSNorm
    return kind(size, config.rms_norm_eps)


class RotaryEmbedding:
    """cos/sin tables [max_position_embeddings, rope_dim], computed once in float32.

    NOTE: plain tensors, not module buffers, so that `model.to(dtype)` never rounds them; they
    are cast to the activation dtype per use, as transformers does.
    """

    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", layer_type: str | None = None
    ) -> None:
        inv_freq, scaling = rope_frequencies(config, layer_type)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and sin [T, 1, D] for positions [T]: once per forward, shared by every layer."""
        return (
            self.cos[positions].to(dtype).unsqueeze(1),
            self.sin[positions].to(dtype).unsqueeze(1),
        )


RopeTables = tuple[torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x [T, H, D] rotated by its rows' positions (the same arithmetic for every head: q's and
    k's heads side by side are rotated in one go); tables narrower than D rotate the first dims
    of each head only."""
    cos, sin = tables
    dim = cos.shape[-1]
    if dim < x.shape[-1]:  # NOTE: partial rotary (Phi-3): the rest of each head passes through
        return torch.cat((rotate(x[..., :dim], tables), x[..., dim:]), dim=-1)
    half = dim // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotated(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """`rotate(x, tables)`, in place where the native kernel takes it (x is then returned):
    for x a fresh projection's view that nothing else reads."""
    return x if cpu_layer_ops.rope_(x, *tables) else rotate(x, tables)


NormMaker = Callable[[ModelConfig, int], RMSNorm]


class Attention(nn.Module):
    fused_weight: torch.Tensor  # buffers of `fuse_rows`, when `fused`
    fused_bias: torch.Tensor | None

    def __init__(self, config: ModelConfig, layer_idx: int, norm: NormMaker = make_norm) -> None:
        """`norm` makes the q/k norms (Gemma's are its own)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_windows[layer_idx]
        self.softcap = config.attn_logit_softcap  # Gemma 2's; None: no cap on the scores
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        # q and k RMS-normed before rope: each head over head_dim (Qwen3), or each whole
        # projection over heads x head_dim (OLMo 2)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":
            self.q_norm, self.k_norm = norm(config, config.head_dim), norm(config, config.head_dim)
        elif config.qk_norm == "projection":
            self.q_norm, self.k_norm = norm(config, q_size), norm(config, kv_size)
        self.group: Group | None = None  # set by `LlamaForCausalLM.join` on a rank of N > 1
        self.fused = False  # q/k/v in one weight (`fuse_rows`)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.fused and self.q_norm is None:
            qkv = cpu_linear.linear(x, self.fused_weight, self.fused_bias)
            qk, v = qkv.view(num_tokens, -1, self.head_dim).split([heads + kv_heads, kv_heads], 1)
            q, k = rotated(qk, rope).split([heads, kv_heads], dim=1)
        else:
            q, k, v = self._qkv(x)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
            # NOTE: float32 rope tables (OLMo 2) rotate in float32; the cast is a no-op otherwise
            q, k = rotated(q, rope).to(x.dtype), rotated(k, rope).to(x.dtype)
        k_cache, v_cache = kv_cache.layer(self.layer_idx)
        scales = kv_cache.layer_scales(self.layer_idx)  # None unless the cache is 8-bit
        dispatch.write_kv(k_cache, v_cache, k, v, meta, scales)
        out = dispatch.paged_attention(
            q, k_cache, v_cache, meta, self.scale, self.sliding_window, scales, self.softcap
        )
        return _reduce(self.group, self.o_proj(out.reshape(num_tokens, -1)))

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] normed per head, or over all of a row's H x D values (`qk_norm`)."""
        if self.qk_norm == "head":
            return norm(x)
        return norm(x.reshape(x.shape[0], -1)).view(x.shape)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D], before any norm or rope."""
        shape = (x.shape[0], -1, self.head_dim)
        if self.fused:
            qkv = cpu_linear.linear(x, self.fused_weight, self.fused_bias).view(shape)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            return q, k, v
        return self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)


class MLP(nn.Module):
    fused_weight: torch.Tensor  # buffers of `fuse_rows`, when `fused`
    fused_bias: torch.Tensor | None

    def __init__(self, config: ModelConfig, inner: int | None = None) -> None:
        """A SwiGLU MLP of `inner` features (default: the config's `intermediate_size`)."""
        super().__init__()
        size, bias = config.hidden_size, config.mlp_bias
        inner = inner or config.intermediate_size
        self.gate_proj = Linear(size, inner, bias=bias)
        self.up_proj = Linear(size, inner, bias=bias)
        self.down_proj = Linear(inner, size, bias=bias)
        self.act_fn = activation(config.hidden_act)
        self.group: Group | None = None
        self.fused = False  # gate/up in one weight (`fuse_rows`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = cpu_linear.linear(x, self.fused_weight, self.fused_bias).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = cpu_layer_ops.silu_mul(gate, up) if self.act_fn is F.silu else None
        if act is None:
            act = self.act_fn(gate) * up
        return _reduce(self.group, self.down_proj(act))


def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: the sparse mixture-of-experts block where the config's
    `sparse_layers` says so (model/moe.py), else the dense `MLP`."""
    if config.sparse_layers and config.sparse_layers[layer_idx]:
        from pagedserve.model.moe import SparseMoeBlock  # NOTE: moe.py builds on this module

        return SparseMoeBlock(config)
    return MLP(config)


def _reduce(group: Group | None, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's output: the sum of every rank's part (tensor_parallel.py)."""
    return partial if group is None else group.all_reduce(partial)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0: Llama's

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream it is to be added to): the next norm adds
        them, in the same call (`RMSNorm.add_norm`). `residual` is None for the first layer."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(
            self._scaled(self.self_attn(h, rope, kv_cache, meta)), residual
        )
        return self._scaled(self.mlp(h)), residual

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        m = self.residual_multiplier
        return branch if m == 1.0 else branch * m


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's layer: no norm before attention or the MLP; each one's output is normed before
    its residual add:  h = x + norm1(attn(x));  out = h + norm2(mlp(h))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`DecoderLayer.forward`'s contract: (the normed MLP output, the stream it is added to)."""
        if residual is not None:
            x = x + residual
        h = x + self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class DecoderStack(nn.Module):
    """`model.*` in the checkpoints: embeddings, layers, final norm. `layer` and `norm` make a
    family's own (Gemma's); the default the family's of this module."""

    def __init__(
        self,
        config: ModelConfig,
        layer: Callable[[ModelConfig, int], nn.Module] | None = None,
        norm: NormMaker = make_norm,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding = Embedding(config.vocab_size, config.hidden_size)
        if layer is None:
            layer = PostNormDecoderLayer if config.post_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_layers))
        self.norm = norm(config, config.hidden_size)


class LlamaForCausalLM(nn.Module):
    """Hidden states for a flattened batch; logits only for the rows the caller asks for."""

    stack: Callable[[ModelConfig], DecoderStack] = DecoderStack  # `model.*`: Gemma's own

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.model = self.stack(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = rope
        self.group: Group | None = None
        # the native decode stack per KV cache (built on first use; None: it cannot run it)
        self._native: tuple[KVCache, NativeStack | None] | None = None

    def join(self, group: Group) -> None:
        """Compute as one rank of `group`: sum the row-parallel layers' parts, look tokens up
        in this rank's vocabulary slice, gather the logits (tensor_parallel.py)."""
        self.group = group
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.group = group

    def fuse_projections(self) -> None:
        """q/k/v and gate/up each read as one weight (`fuse_rows`); on an empty model."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.fused = fuse_rows(module, ("q_proj", "k_proj", "v_proj"))
            elif isinstance(module, MLP):
                module.fused = fuse_rows(module, ("gate_proj", "up_proj"))

    def tie_weights(self) -> None:
        # NOTE: an int8 table from GGUF Q8_0 is tied at load (QuantizedEmbedding.head)
        if self.config.tie_word_embeddings and isinstance(self.model.embed_tokens, nn.Embedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden].

        Writes this step's K/V into `kv_cache` at `meta.slot_mapping` for every layer.
        """
        native = self._native_stack(kv_cache)
        if native is not None:
            hidden = native.forward(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        x, residual = self._embed(input_ids), None
        rope = self.rope.at(positions, torch.float32 if self.config.late_casts else x.dtype)
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.model.norm.add_norm(x, residual)[0]

    def _native_stack(self, kv_cache: KVCache) -> NativeStack | None:
        """The one-call decode stack over `kv_cache` (model/native_stack.py), built once."""
        if self._native is None or self._native[0] is not kv_cache:
            self._native = (kv_cache, NativeStack.build(self, kv_cache))
        return self._native[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids`, times `embedding_multiplier` (Granite's; Gemma's
        sqrt(hidden), rounded to the model's dtype first as transformers rounds it)."""
        m = self.config.embedding_multiplier
        if self.group is None:
            x = self.model.embed_tokens(input_ids)
        else:
            assert self.config.tp is not None
            start, end = self.config.tp.vocab
            outside = (input_ids < start) | (input_ids >= end)
            x = self.model.embed_tokens((input_ids - start).masked_fill(outside, 0))
            x = self.group.all_reduce(x.masked_fill(outside[:, None], 0.0))
        if m == 1.0:
            return x
        if self.config.embedding_multiplier_in_dtype:
            return x * torch.tensor(m, dtype=torch.float32).to(x.dtype)
        return x * m

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab]. On tensor-parallel ranks rank 0 gathers every rank's
        vocabulary slice; the others get their own slice back (and never sample). Granite's
        are divided by `logits_scaling`, as transformers divides them, in the model's dtype;
        Gemma's soft-capped (`final_logit_softcap`: cap * tanh(logits / cap)), in that dtype too."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.group is None:
            return logits
        gathered = self.group.gather_last_dim(logits)
        return logits if gathered is None else gathered
