"""A decode step's decoder layers in one native call (kernels/cpu_stack.py, csrc/decode_stack.c).

At one token per step on CPU the weights are read in ~20 ms (SmolLM2, fp32), and the Python
path's ~14 calls per layer added ~10 ms more; `NativeStack` replaces the loop over layers with
one call that runs the same kernels. It takes a step when every part of it is what the kernels
compute — float32 on CPU, a plain (unquantized) float32 KV cache, chunks of at most
`MAX_CHUNK` tokens per sequence (decode steps, speculative verification: each row attends
causally on its own), at most `max_rows` rows, no tensor parallelism, Llama's layer (fused
fp32 q/k/v and gate/up, or int8 / int4 linears the native kernels read, SiLU, at most one
sliding window, no q/k norms, no attention soft cap (an `Attention.softcap` that is not None),
Llama's pre-norms and RMSNorm, no residual multiplier, rope over whole heads: Qwen3's, OLMo
2's, Granite's and Gemma's layers and Phi-3's partial rotary take the Python path; the attention
scale is the model's own, Granite's `attention_multiplier` included, the rope tables are the
model's, longrope's included, and the embedding multiplier and logits scaling lie outside the
stack) — and otherwise `forward` returns None and the model runs its Python path. Its outputs
are the Python path's except for SiLU's exponential (a few ulp: docs/kernels.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

from pagedserve.kernels import cpu_linear, cpu_native, cpu_stack, cpu_w8a8, dispatch, mkl_packed
from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.model import quant

if TYPE_CHECKING:
    from pagedserve.model.llama import LlamaForCausalLM

enabled = True  # tests and benchmarks switch it off to compare with the layer-by-layer path
# The longest chunk of one sequence a step may hold: 1 + the most speculative tokens (16). Each
# row attends on its own, so a long prefill chunk is left to the Python path's batched kernels.
MAX_CHUNK = 17


class NativeStack:
    """The layer table of one model over one KV cache, built once (`build`); it holds every
    tensor the table points to. Single-threaded: the model runner's step thread calls it."""

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: KVCache, layers: list[cpu_stack.Layer],
        keep: list[torch.Tensor], window: int | None, max_rows: int,
    ) -> None:  # fmt: skip
        config = model.config
        self.model, self.kv_cache, self.window, self.max_rows = model, kv_cache, window, max_rows
        self.layers = (cpu_stack.Layer * len(layers))(*layers)
        self._keep = keep
        self.shape = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                      config.intermediate_size)  # fmt: skip
        self.scratch = torch.empty(cpu_stack.scratch_floats(max_rows, *self.shape))
        k_cache = kv_cache.layer(0)[0]
        self.cache_strides = (k_cache.shape[1], k_cache.stride(0), k_cache.stride(1))

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_cache: KVCache) -> NativeStack | None:
        """The stack, or None where some part of the model or cache is not what it computes."""
        config = model.config
        if (
            cpu_stack.library() is None
            or config.dtype != torch.float32
            or model.group is not None
            or kv_cache.scales is not None
            or kv_cache.codes.dtype != torch.float32
            or kv_cache.codes.device.type != "cpu"
            or config.head_dim % 16
            or config.rope_dim != config.head_dim  # NOTE: its kernel rotates whole heads
            or config.head_dim > 512
            or config.num_heads > cpu_native.MAX_HEADS
            or len({w for w in config.sliding_windows if w is not None}) > 1
            or config.is_moe  # NOTE: its kernels compute dense MLPs only
        ):
            return None
        keep: list[torch.Tensor] = []
        layers, max_rows = [], quant.NATIVE_ROWS
        for index, module in enumerate(model.model.layers):
            described = _layer(module, kv_cache, index, keep)
            if described is None:
                return None
            layers.append(described[0])
            max_rows = min(max_rows, described[1])
        if not _is_norm(model.model.norm):
            return None
        keep.append(model.model.norm.weight)
        window = next((w for w in config.sliding_windows if w is not None), None)
        return cls(model, kv_cache, layers, keep, window, max_rows)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final norm's output [rows, hidden] for this step (K/V written at
        `meta.slot_mapping`), or None, having done nothing, where the step is not one it takes."""
        rows = input_ids.shape[0]
        if (
            not enabled
            or not 0 < rows <= self.max_rows
            or max(meta.query_lens) > MAX_CHUNK
            or input_ids.device.type != "cpu"
            or dispatch.backend_for(input_ids.device) != "cpu"
            or cpu_stack.library() is None
        ):
            return None
        x = self.model._embed(input_ids).contiguous()
        rope = self.model.rope
        cos, sin = rope.cos[positions].contiguous(), rope.sin[positions].contiguous()
        # NOTE: a step with chunks (speculative verification) attends row by row, causally
        every_row = not meta.is_decode_only
        plan = meta.cpu_native_plan(None, every_row)
        window = meta.cpu_native_plan(self.window, every_row).firsts if self.window else plan.firsts
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        config = self.model.config
        block_size, blk, pos = self.cache_strides
        step = cpu_stack.Step(
            rows, *self.shape, block_size, blk, pos, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), plan.tables.data_ptr(), plan.tables.stride(0),
            plan.query_rows.data_ptr(), plan.firsts.data_ptr(), window.data_ptr(),
            plan.ends.data_ptr(), config.rms_norm_eps, config.attention_scale,
            torch.get_num_threads(),
        )  # fmt: skip
        cpu_stack.run(self.layers, step, self.model.model.norm.weight, x, self.scratch)
        return x


def _is_norm(module: nn.Module) -> bool:
    from pagedserve.model.llama import RMSNorm

    return type(module) is RMSNorm and _is_f32(module.weight)


def _layer(
    module: nn.Module, kv_cache: KVCache, index: int, keep: list[torch.Tensor]
) -> tuple[cpu_stack.Layer, int] | None:
    """One decoder layer's table entry and the most rows its linears take natively, or None if
    any part of it is not what the kernels compute. NOTE: a layer variant (another family's
    norms, rope or activation) must be declined here, or the stack computes Llama's layer."""
    from pagedserve.model.llama import MLP, Attention, DecoderLayer

    if type(module) is not DecoderLayer:
        return None
    attn, mlp = module.self_attn, module.mlp
    if type(attn) is not Attention or type(mlp) is not MLP or mlp.act_fn is not F.silu:
        return None
    # NOTE: Qwen3's, OLMo 2's q/k norms; Gemma 2's soft cap (the stack's attention has none)
    if attn.q_norm is not None or attn.k_norm is not None or getattr(attn, "softcap", None):
        return None
    if module.residual_multiplier != 1.0:  # NOTE: Granite's scaled residual branches
        return None
    if not (_is_norm(module.input_layernorm) and _is_norm(module.post_attention_layernorm)):
        return None
    qkv = _parts(attn, ("q_proj", "k_proj", "v_proj"), keep)
    gate_up = _parts(mlp, ("gate_proj", "up_proj"), keep)
    o, down = _linear(attn.o_proj, keep), _linear(mlp.down_proj, keep)
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    k_cache, v_cache = kv_cache.layer(index)
    if k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3]:
        return None
    keep.extend((module.input_layernorm.weight, module.post_attention_layernorm.weight))
    layer = cpu_stack.Layer(
        input_norm=module.input_layernorm.weight.data_ptr(),
        post_norm=module.post_attention_layernorm.weight.data_ptr(),
        o=o[0], down=down[0], qkv_parts=len(qkv[0]), gate_up_parts=len(gate_up[0]),
        k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        windowed=int(attn.sliding_window is not None),
    )  # fmt: skip
    for i, part in enumerate(qkv[0]):
        layer.qkv[i] = part
    for i, part in enumerate(gate_up[0]):
        layer.gate_up[i] = part
    return layer, min(qkv[1], gate_up[1], o[1], down[1])


def _parts(
    parent: nn.Module, names: tuple[str, ...], keep: list[torch.Tensor]
) -> tuple[list[cpu_stack.Linear], int] | None:
    """The linears `names` of `parent` side by side: its fused weight (`fuse_rows`) as one
    part, or each layer as its own; and the most rows all of them take natively."""
    if getattr(parent, "fused", False):
        weight, bias = parent.fused_weight, parent.fused_bias
        assert isinstance(weight, torch.Tensor) and not isinstance(bias, nn.Module)
        one = _f32_linear(weight, bias, keep)
        return None if one is None else ([one[0]], one[1])
    described = [_linear(getattr(parent, name), keep) for name in names]
    linears = [d for d in described if d is not None]
    if len(linears) < len(names):
        return None
    return [d[0] for d in linears], min(d[1] for d in linears)


def _linear(module: nn.Module, keep: list[torch.Tensor]) -> tuple[cpu_stack.Linear, int] | None:
    """A linear's kernel entry and the most rows it takes natively, or None."""
    from pagedserve.model.llama import Linear

    if type(module) is Linear:
        return _f32_linear(module.weight, module.bias, keep)
    if not isinstance(module, quant.QuantizedLinear):
        return None
    bias = module.bias
    if module.w8a8:
        return _w8a8_linear(module, keep)
    operands = module.cpu_operands()
    if operands is None or not _is_f32(bias):
        return None
    codes, scales, group = operands
    keep.extend(t for t in (codes, scales, bias) if t is not None)
    kind = cpu_stack.I4G if module.quant.method == "int4" else cpu_stack.I8G
    linear = cpu_stack.Linear(
        kind, codes.data_ptr(), scales.data_ptr(), None, None if bias is None else bias.data_ptr(),
        module.out_features, module.in_features, group,
    )  # fmt: skip
    return linear, quant.NATIVE_ROWS


def _w8a8_linear(
    module: quant.QuantizedLinear, keep: list[torch.Tensor]
) -> tuple[cpu_stack.Linear, int] | None:
    """A w8a8 layer's entry: the VNNI kernel's (csrc/linear_w8a8.c); None without VNNI."""
    operands = module.w8a8_operands()
    if operands is None or not cpu_w8a8.has_vnni() or not _is_f32(module.bias):
        return None
    codes, scales, sums = operands
    bias = module.bias
    keep.extend(t for t in (codes, scales, sums, bias) if t is not None)
    linear = cpu_stack.Linear(
        cpu_stack.W8A8, codes.data_ptr(), scales.data_ptr(), sums.data_ptr(),
        None if bias is None else bias.data_ptr(), module.out_features, module.in_features,
    )  # fmt: skip
    return linear, quant.NATIVE_ROWS


def _f32_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, keep: list[torch.Tensor]
) -> tuple[cpu_stack.Linear, int] | None:
    if not (_is_f32(weight) and weight.dim() == 2 and _is_f32(bias)):
        return None
    packed = mkl_packed.packed(weight)
    keep.extend(t for t in (weight, bias, packed) if t is not None)
    n, k = weight.shape
    linear = cpu_stack.Linear(cpu_stack.F32, weight.data_ptr(), None, None,
                              None if bias is None else bias.data_ptr(), n, k,
                              packed=None if packed is None else packed.data_ptr())  # fmt: skip
    # NOTE: MKL on the packed copy takes any batch; the native GEMM is kept to its best range
    return linear, cpu_linear.MAX_TOKENS if packed is not None else cpu_linear.GEMM_MAX_TOKENS


def _is_f32(tensor: torch.Tensor | None) -> bool:
    """None, or a contiguous float32 tensor on CPU."""
    return tensor is None or (
        tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
    )
