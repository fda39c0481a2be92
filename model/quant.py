"""Weight-only quantization of the decoder's linear layers (`--quantization int8|int4`).

The weights are quantized once, as the loader reads each tensor; activations, norms, the
embedding, the LM head and the KV cache keep the model's dtype (as vLLM's and TGI's weight-only
modes do). Two formats:

- **int8**: one symmetric scale per output channel, `w = q * s`, q in [-127, 127].
- **int4**: one affine (scale, zero) pair per group of `group_size` input features,
  `w = (q - 8) * scale + zero`, q in [0, 15], the convention of ATen's packed int4 matmul (a
  GGUF Q4_0 block is `zero = 0`; Q4_1's `d * q + m` is `zero = m + 8 d`).
- **int8 in groups**: only as a GGUF file stores it (Q8_0: `w = d * q` per 32 weights), read
  from the file's blocks (`load_int8_groups`, model/gguf_weights.py), for decoder linears and
  for the embedding and tied LM head (`QuantizedEmbedding`). On CPU a native kernel
  (kernels/csrc/linear_i8g.c) widens the codes in registers for decode-sized batches.

With bf16 activations on CPU the matmuls are ATen's packed kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`), which read the small weights and dequantize inside the GEMM.
Those kernels have a fast path for bf16 only: with fp32 activations they were 13-100x slower
than `F.linear` on this project's machine (AVX-512, torch 2.13; docs/quantization.md). So with
fp32 and fp16 activations, up to `NATIVE_ROWS` rows, per-channel int8 takes the grouped int8
kernel too (one group per row) and int4 its own (kernels/csrc/linear_i4g.c): both read the
codes once and turn them into weights in registers, the weights' values those of `dequantize`
(int4 with AVX-512: the same roundings; with AVX2 an FMA, within one rounding). Larger batches
(prefill chunks) multiply by the dequantized weight, one dequantization shared by every row.
An int4 layer holds its codes once, in the layout its dtype's matmul reads (`load_int4`): the
native kernel's for an fp32 or fp16 layer on CPU, ATen's for bf16 (and on CUDA, where the
Triton kernels read a copy built on first use). CUDA runs Triton kernels.

NOTE: the Triton kernels (kernels/triton_quant.py) are imported on first use on CUDA, as
kernels/dispatch.py imports its own: Triton reads `TRITON_INTERPRET` when the kernels are
defined, and a CPU-only host need not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cli_options import QUANTIZATION_GROUP_SIZES as GROUP_SIZES
from pagedserve.cli_options import QUANTIZATION_METHODS as METHODS
from pagedserve.cli_options import check_quantization, quantization_name
from pagedserve.kernels import cpu_dequant, cpu_native, cpu_w8a8

INT4_MAX = 15
INT8_MAX = 127
# Grouped int8 on CPU: the native kernel up to this many rows (SmolLM2's LM head, 2 cores: 2.8x
# fp32 F.linear at 1 row, 2.4x at 16, 0.87x at 64, and ahead of dequantizing the weight each
# call until about 270 rows; docs/quantization.md). int4 takes the same bound: over SmolLM2's
# 210 linears its kernel at 256 rows (a first version) still took half the dequantizing path's
# time, though 1.5x fp32 F.linear's
NATIVE_ROWS = 256


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """How the linear layers' weights are stored. `group_size` is int4's (input features per
    (scale, zero) pair)."""

    method: str
    group_size: int = 32
    lm_head: bool = False  # the LM head in int8 per channel too (`quantize_head`)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization: {self.method!r} is not one of {list(METHODS)}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size: {self.group_size} is not one of {list(GROUP_SIZES)}"
            )

    @property
    def name(self) -> str:
        """The spelling in fingerprints, logs and reports: `int8`, `int4-g128`. NOTE: without
        `lm_head`: the head makes no KV, so it is no part of a block's identity."""
        return quantization_name(self.method, self.group_size)

    @property
    def int8_codes(self) -> bool:
        """Whether the weights are int8 codes with a scale per output channel (or per group,
        from a GGUF): `int8` and `w8a8` store the same."""
        return self.method in ("int8", "w8a8")


def weight_quant(
    method: str | None, group_size: int = 32, lm_head: bool = False
) -> WeightQuant | None:
    """The flags' value: None (or "none") keeps the weights in the model's dtype; ValueError
    for `lm_head` without a method."""
    check_quantization(method, lm_head)
    if method in (None, "", "none"):
        return None
    return WeightQuant(method, group_size, lm_head)


def weight_quant_from_args(args: Any) -> WeightQuant | None:
    """`--quantization`, `--quantization-group-size` and `--quantize-lm-head` of a worker's
    command line."""
    return weight_quant(
        getattr(args, "quantization", None),
        getattr(args, "quantization_group_size", 32),
        getattr(args, "quantize_lm_head", False),
    )


def quantize_head(head: nn.Linear, method: str = "int8") -> QuantizedLinear:
    """An int8 (per output channel) copy of a loaded LM head, on its device, scales in its
    dtype: what `--quantize-lm-head` puts in its place (a tied head's table stays the
    embedding's)."""
    weight = head.weight.detach()
    with torch.device(weight.device):
        q = QuantizedLinear(head.in_features, head.out_features, False, WeightQuant(method))
    q.scales = q.scales.to(weight.dtype)
    q.load_weight(weight)
    return q


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is int8 or packed int4; same checkpoint name (`.weight`)
    and bias as `nn.Linear`. `load_weight` quantizes a float [out, in] tensor into it."""

    qweight: torch.Tensor  # int8 [out, in]; int4 [out, in / 2], two codes a byte (`int4_layout`)
    scales: torch.Tensor  # int8: [out], or [out, in / group]; int4: see `int4_layout`
    # int4's codes and (scale, zero) pairs are held once, in one of two layouts: "native"
    # (cpu_native.pack_int4, and pack_int4_scales' float16 [tiles of 16 rows, groups, 2, 16],
    # what the fp32 / fp16 CPU kernel reads) or "aten" (`_convert_weight_to_int4pack_for_cpu`
    # and [groups, out, 2] in the activations' dtype, what ATen's bf16 CPU matmul reads); a
    # call that needs the other repacks them
    int4_layout: str

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: WeightQuant) -> None:
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        if quant.method == "int4":
            if in_features % quant.group_size:
                raise ValueError(
                    f"quantization_group_size: {quant.group_size} does not divide a linear "
                    f"layer's {in_features} input features"
                )
            groups = in_features // quant.group_size
            self.register_buffer(
                "qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
            )
            self.register_buffer("scales", torch.empty(groups, out_features, 2))
        else:
            self.register_buffer(
                "qweight", torch.empty(out_features, in_features, dtype=torch.int8)
            )
            self.register_buffer("scales", torch.empty(out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._cuda_operands: tuple[torch.Tensor, ...] | None = None
        self.int4_layout = "aten"
        self._w8a8_sums: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def w8a8(self) -> bool:
        """Whether this layer quantizes its activations per row (`--quantization w8a8`; a
        GGUF's grouped Q8_0 layer keeps float activations)."""
        return self.quant.method == "w8a8" and self.scales.dim() == 1

    @property
    def int8_groups(self) -> bool:
        """Whether this int8 layer has a scale per group of input features (GGUF Q8_0)."""
        return self.quant.int8_codes and self.scales.dim() == 2

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.quant.name}"
        )

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Quantize `weight` [out, in] (any float dtype) into this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}, want "
                f"{(self.out_features, self.in_features)}"
            )
        w = weight.to(torch.float32)
        if self.quant.int8_codes:
            q, scales = quantize_int8(w)
            self.qweight.copy_(q)
            self._cuda_operands = self._w8a8_sums = None
            self.scales.copy_(scales)
        else:
            q, scale, zero = quantize_int4(w, self.quant.group_size)
            self.load_int4(q, scale, zero)

    @torch.no_grad()
    def load_int4(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Store int4 codes q [out, in] in [0, 15] with scale and zero [out, in / group] (the
        weight is `(q - 8) * scale + zero`), e.g. straight from a GGUF Q4 block. On CPU, a layer
        in float32 or float16 (its scales' dtype: the model's) holds them in the native kernel's
        layout, one in bfloat16 (or on CUDA) in ATen's: the layout its own dtype's matmul reads."""
        dtype = self.scales.dtype
        native = self.qweight.device.type == "cpu" and dtype != torch.bfloat16
        self._store_int4(
            q.to(torch.int32).cpu(), scale, zero, "native" if native else "aten", dtype
        )

    @torch.no_grad()
    def load_int8_groups(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Store int8 codes q [out, in] with one float32 scale per group of input features,
        scale [out, in / group] (the weight is `q * scale`), e.g. straight from GGUF Q8_0
        blocks. Only an int8 layer takes them."""
        if not self.quant.int8_codes:
            raise ValueError(f"quantization: int8 codes for an {self.quant.name} layer")
        if tuple(q.shape) != (self.out_features, self.in_features) or (
            scale.shape[0] != self.out_features or self.in_features % scale.shape[1]
        ):
            raise ValueError(
                f"int8 codes {tuple(q.shape)} and scales {tuple(scale.shape)} do not fit "
                f"{(self.out_features, self.in_features)}"
            )
        self.qweight.copy_(q)
        self.scales = scale.to(device=self.qweight.device, dtype=torch.float32).contiguous()
        self._cuda_operands = self._w8a8_sums = None

    def int4_codes(self) -> torch.Tensor:
        """int4's codes [out, in] (int32, on CPU), read back from either layout."""
        if self.int4_layout == "native":
            return cpu_native.unpack_int4(self.qweight.cpu())
        return unpack_int4(self.qweight.cpu(), self.out_features, self.in_features)

    def int4_scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int4's scale and zero [out, in / group], read back from either layout (float32 from
        the native one)."""
        if self.int4_layout == "native":
            return cpu_native.unpack_int4_scales(self.scales, self.out_features)
        return self.scales[..., 0].t(), self.scales[..., 1].t()

    def _store_int4(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, layout: str,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        """Codes [out, in] (int32, on CPU) and scale, zero [out, in / group] into `layout`, the
        pairs float16 in the native one and `dtype` (the activations') in ATen's."""
        if layout == "native":
            packed = cpu_native.pack_int4(q)
            pairs = cpu_native.pack_int4_scales(scale, zero)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            pairs = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype)  # [groups, out, 2]
        self.qweight.copy_(packed)
        self.scales = pairs.to(device=self.scales.device).contiguous()
        self.int4_layout = layout
        self._cuda_operands = None

    def _use_int4_layout(self, layout: str, dtype: torch.dtype) -> None:
        """Repack codes and pairs if they are in the other layout (once per change of
        activation dtype: a model runs in one, so in practice at load time only)."""
        if self.int4_layout != layout:
            self._store_int4(self.int4_codes(), *self.int4_scale_zero(), layout, dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight as the matmul sees it, [out, in] in the scales' dtype (float32 for int4
        held natively: `q * scale + low`, GGUF Q4_1's form): for batches above NATIVE_ROWS,
        the reference path and tests."""
        if self.int8_groups:
            return dequantize_int8_groups(self.qweight, self.scales)
        if self.quant.int8_codes:
            return self.qweight.to(self.scales.dtype) * self.scales[:, None]
        if self.int4_layout == "native":
            return cpu_dequant.dequantize_int4(self.qweight, self.scales, self.in_features)
        q = self.int4_codes().to(self.qweight.device)
        scale, zero = self.int4_scale_zero()  # [out, groups]
        g = self.quant.group_size
        q = q.view(self.out_features, -1, g).to(scale.dtype)
        return ((q - 8) * scale[..., None] + zero[..., None]).view(self.out_features, -1)

    def cuda_operands(self) -> tuple[torch.Tensor, ...]:
        """What the Triton kernels read (kernels/triton_quant.py), built on first use and kept:
        int8 (codes, scale); int4 (nibble-packed codes [out, in / 2], scale, zero [out, groups]).
        NOTE: int4's copy sits beside ATen's packed codes (a second copy of the small codes)."""
        if self._cuda_operands is None:
            if self.quant.int8_codes:
                self._cuda_operands = (self.qweight, self.scales.float())
            else:
                from pagedserve.kernels.triton_quant import pack_nibbles

                q = self.int4_codes()
                scale, zero = self.int4_scale_zero()
                self._cuda_operands = (
                    pack_nibbles(q).to(self.qweight.device),
                    scale.float().contiguous(),
                    zero.float().contiguous(),
                )
        return self._cuda_operands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on_cpu = x.device.type != "cuda"
        if on_cpu and (self.int8_groups or x.dtype != torch.bfloat16):
            return self._native_cpu(x)
        shape = x.shape
        out = self._packed_matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def _native_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """On CPU, int8 grouped (GGUF Q8_0, any activations) or per channel (a group of the
        whole row) and int4 with fp32/fp16 activations: the native kernels for up to
        `NATIVE_ROWS` rows (they read the codes once per tile of rows: faster than fp32
        `F.linear` there), else, or where a kernel declines, `F.linear` on the dequantized
        weight."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        operands = self.w8a8_operands()
        if operands is not None:
            w8a8 = cpu_w8a8.linear(x2.float(), *operands[:2], self.bias, operands[2])
            return w8a8.to(x.dtype).view(*shape[:-1], self.out_features)
        out = None
        if x2.shape[0] <= NATIVE_ROWS and self.quant.method == "int4":
            out = cpu_native.linear_int4_groups(x2, self.qweight, self._int4_cpu_pairs())
        elif x2.shape[0] <= NATIVE_ROWS:
            scales = self.scales if self.int8_groups else self.scales.view(-1, 1)
            out = cpu_native.linear_int8_groups(x2, self.qweight, scales)
        if out is None:
            return F.linear(x, self.dequantize().to(x.dtype), self.bias)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], self.out_features)

    def w8a8_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, scales, the codes' int32 row sums) of a w8a8 layer on CPU (the sums are
        computed once, for the VNNI kernel), else None."""
        if not self.w8a8 or self.qweight.device.type != "cpu":
            return None
        sums = self._w8a8_sums
        if sums is None or sums[0] is not self.qweight:
            sums = (self.qweight, cpu_w8a8.code_sums(self.qweight))
            self._w8a8_sums = sums
        return self.qweight, self.scales, sums[1]

    def cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(codes, scales, group): what the native CPU kernels read for float32 activations
        (int4's codes and float16 pairs in their layout; int8's scales per group, or per
        channel as one group of the whole row), or None where no kernel takes this layer."""
        if self.qweight.device.type != "cpu" or self.w8a8:
            return None  # NOTE: w8a8's int8 activations are not what these kernels compute
        if self.quant.method == "int4":
            if self.scales.dtype == torch.bfloat16:
                return None  # a bf16 layer's: ATen's layout, for its bf16 matmul
            pairs = self._int4_cpu_pairs()
            if self.in_features % (32 * pairs.shape[1]):
                return None
            return self.qweight, pairs, self.in_features // pairs.shape[1]
        scales = self.scales if self.int8_groups else self.scales.view(-1, 1)
        group = self.in_features // scales.shape[1]
        if scales.dtype != torch.float32 or group % 16 or not scales.is_contiguous():
            return None
        return self.qweight, scales, group

    def _int4_cpu_pairs(self) -> torch.Tensor:
        """int4's pairs in the native layout, float16 (as `pack_int4_scales` made them; a
        `.to(dtype)` of the module since widened them, and narrowing them back is exact)."""
        self._use_int4_layout("native", torch.float16)
        if self.scales.dtype != torch.float16:
            self.scales = self.scales.half()
        return self.scales

    def _packed_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] @ W.T from the codes: Triton on CUDA, ATen's packed kernels on CPU."""
        if x2.device.type == "cuda":
            from pagedserve.kernels import triton_quant

            ops = self.cuda_operands()
            if self.quant.int8_codes:
                return triton_quant.int8_linear(x2, ops[0], ops[1])
            return triton_quant.int4_linear(x2, ops[0], ops[1], ops[2], self.quant.group_size)
        if self.quant.int8_codes:
            return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        self._use_int4_layout("aten", x2.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.qweight, self.quant.group_size, self.scales
        )


class QuantizedEmbedding(nn.Module):
    """An embedding table held as int8 codes with a float32 scale per group of features (GGUF
    Q8_0), dequantized row by row as it is looked up; `head()` is the tied LM head over the
    same codes (no second copy)."""

    codes: torch.Tensor  # int8 [num_embeddings, embedding_dim]
    scales: torch.Tensor  # float32 [num_embeddings, embedding_dim / group]

    def __init__(self, num_embeddings: int, embedding_dim: int, group: int, dtype: torch.dtype):
        super().__init__()
        if embedding_dim % group:
            raise ValueError(f"embedding: group {group} does not divide {embedding_dim} features")
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("codes", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, embedding_dim // group))

    @torch.no_grad()
    def load(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.shape != self.codes.shape or scales.shape != self.scales.shape:
            raise ValueError(
                f"embedding: codes {tuple(codes.shape)} and scales {tuple(scales.shape)}, want "
                f"{tuple(self.codes.shape)} and {tuple(self.scales.shape)}"
            )
        self.codes.copy_(codes)
        self.scales.copy_(scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int8_groups(self.codes[ids], self.scales[ids]).to(self.dtype)

    def head(self) -> QuantizedLinear:
        """The LM head `x @ table.T` over this table's codes and scales (shared tensors)."""
        head = QuantizedLinear(self.embedding_dim, self.num_embeddings, False, WeightQuant("int8"))
        head.qweight, head.scales = self.codes, self.scales
        return head


def dequantize_int8_groups(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., in] int8 and scales [..., in / group] -> float32 [..., in]."""
    groups = scales.shape[-1]
    w = codes.to(torch.float32).unflatten(-1, (groups, -1)) * scales[..., None]
    return w.flatten(-2)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [out, in] int8, scales [out])."""
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """Group-wise affine int4 (min-max per group): (q [out, in] in [0, 15], scale and zero
    [out, in / group], float32) with `w ~ (q - 8) * scale + zero`. The scale and the minimum
    `zero - 8 * scale` are float16 values, as a GGUF Q4_1 block's d and m (the native CPU
    kernel reads them so): the minimum rounded down, so no weight lies below code 0, and the
    codes counted from it, so every weight is within half a step of its code's."""
    out_features = w.shape[0]
    groups = w.view(out_features, -1, group_size).float()
    low = groups.amin(dim=-1)
    half = low.half()  # NOTE: to nearest; one step down where that rounded up
    down = torch.nextafter(half, torch.full_like(half, float("-inf")))
    low = torch.where(half.float() > low, down, half).float()
    scale = ((groups.amax(dim=-1) - low) / INT4_MAX).clamp(min=2.0**-24).half().float()
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, INT4_MAX)
    return q.view(out_features, -1).to(torch.uint8), scale, low + 8 * scale


_BLOCK_SIZES = (64, 32)  # output rows per block: 4 vectors of floats, AVX-512 / AVX2


@cache
def _block_n() -> int | None:
    """Output rows per block of ATen's CPU int4 packing, probed once: [out / B, in, B / 2]
    bytes, the low nibble from the first B / 2 rows of each block and the high nibble from the
    others. B is 4 vectors of torch's float width: 64 with AVX-512, 32 with AVX2. None for a
    layout this does not know (another CPU capability)."""
    for block in _BLOCK_SIZES:
        q = torch.arange(block * 32, dtype=torch.int32).view(block, 32) % 13
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        if torch.equal(_unpack_blocked(packed, block, 32, block), q):
            return block
    return None


def _unpack_blocked(
    packed: torch.Tensor, out_features: int, in_features: int, block: int
) -> torch.Tensor:
    blocks = packed.reshape(out_features // block, in_features, block // 2)
    low, high = (blocks & 0xF).to(torch.int32), (blocks >> 4).to(torch.int32)
    return torch.cat([low, high], dim=2).transpose(1, 2).reshape(out_features, in_features)


def unpack_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The codes [out, in] (int32) of a `_convert_weight_to_int4pack_for_cpu` tensor: by its
    layout where ATen uses a blocked one, else by running its matmul against the identity
    with unit scales (layout-agnostic, exact: small integers in fp32, but slow)."""
    block = _block_n()
    if (
        block is not None
        and out_features % block == 0
        and packed.numel() * 2 == out_features * in_features
    ):
        return _unpack_blocked(packed, out_features, in_features, block)
    eye = torch.eye(in_features, dtype=torch.float32)
    ones = torch.stack(
        [
            torch.ones(in_features // 32, out_features),
            torch.full((in_features // 32, out_features), 8.0),
        ],
        dim=-1,
    )
    codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, ones)  # [in, out]
    return codes.t().round().to(torch.int32)


@torch.no_grad()
def dequantize_into(hf_model: Any, quant: WeightQuant) -> Any:
    """Give a transformers Llama-family model the weights a quantized pagedserve model computes
    with (each decoder linear weight quantized, then dequantized): the oracle of the quantized
    paths, and the model the bench's perplexity runs."""
    for layer in hf_model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for child in parent.children():
                if isinstance(child, nn.Linear):
                    q = QuantizedLinear(child.in_features, child.out_features, False, quant)
                    q.load_weight(child.weight.data)
                    child.weight.data = q.dequantize().to(child.weight.dtype)
    if quant.lm_head:
        head = hf_model.lm_head
        # NOTE: a new Parameter unties a tied head: the embedding keeps its own values
        head.weight = nn.Parameter(quantize_head(head).dequantize().to(head.weight.dtype))
    return hf_model


def quantized_bytes(
    in_features: int, out_features: int, quant: WeightQuant, dtype: torch.dtype
) -> int:
    """Bytes of one quantized weight in a model of `dtype` on CPU (codes and scales; its bias is
    the caller's): int4's pairs float16 in tiles of 16 rows (`cpu_native.pack_int4_scales`)
    except in a bf16 model (ATen's layout, in bf16)."""
    if quant.int8_codes:
        return out_features * in_features + out_features * dtype.itemsize
    groups = in_features // quant.group_size
    rows = out_features if dtype == torch.bfloat16 else -(-out_features // 16) * 16
    return out_features * in_features // 2 + groups * rows * 2 * 2
