"""Weights straight from a GGUF file's quantized blocks (`--quantization int4|int8`).

A model converted from GGUF (`pagedserve fetch-model`, `--model FILE.gguf`) is an fp32 Hugging
Face directory whose `pagedserve-source.json` names the GGUF it came from. With quantized
weights, the loader takes what the GGUF stores in a format it computes with from the file's
blocks instead: the file's own codes and scales, never dequantized to fp32 and quantized again.

- `--quantization int4` in groups of 32: decoder linears stored as Q4_0 or Q4_1
  (`QuantizedLinear.load_int4`).
- `--quantization int8`: decoder linears stored as Q8_0 (`QuantizedLinear.load_int8_groups`).
- either: the token embedding stored as Q8_0 (`QuantizedEmbedding`), which with tied
  embeddings is the LM head too; an untied `output.weight` stored as Q8_0 likewise.

    Q4_0 block (18 bytes, 32 weights): d fp16, 16 bytes of codes   w = d * (q - 8)
    Q4_1 block (20 bytes, 32 weights): d fp16, m fp16, 16 bytes    w = d * q + m
    Q8_0 block (34 bytes, 32 weights): d fp16, 32 int8 codes       w = d * q
    Q4 codes: byte j holds weight j (low nibble) and weight j + 16 (high nibble)

In ATen's packed int4 format (`w = (q - 8) * scale + zero`) that is scale = d and zero = 0
(Q4_0) or m + 8 d (Q4_1). llama.cpp stores q and k rows permuted for its rotary layout in
files of its "llama" architecture (Llama, Mistral); transformers' GGUF loader undoes it for
those, and so do we (the same row permutation of the codes); qwen2, qwen3, gemma2 and gemma3
files keep HF's order. Files of other architectures (phi3's fused qkv and gate/up, the
mixtures of experts, which `--quantization` refuses anyway) give no blocks here. Other tensor
types (F32, F16, K-quants) load from the safetensors as before.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.fetch_model import SOURCE_FILE, known_gguf
from pagedserve.gguf_header import read_gguf_header

if TYPE_CHECKING:
    from pagedserve.model.quant import WeightQuant

log = logging.getLogger(__name__)

GROUP = 32  # weights per Q4 / Q8_0 block
# the files whose decoder linears are the separate q/k/v/o and gate/up/down tensors read here
BLOCK_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_WHOLE = {"token_embd.weight": EMBEDDING, "output.weight": HEAD}
_LAYER = re.compile(
    r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight"
)
_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, if it is still there."""
    marker = Path(model_dir) / SOURCE_FILE
    if not marker.is_file():
        return None
    source = json.loads(marker.read_text())
    path = source.get("gguf_path")
    if path is None:  # NOTE: converted before gguf_path was recorded
        name = str(source.get("source", ""))
        try:
            path = name if name.endswith(".gguf") else str(known_gguf(name))
        except ValueError:
            return None
    found = Path(path)
    return found if found.is_absolute() and found.is_file() else None


def _rope_rows(rows: int, num_heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers'
    `_reverse_permute_weights`): new row i is stored row order[i]."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)


def decode_q4(
    blocks: np.ndarray, kind: str, in_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 tensor's bytes [out, in / 32 * block] -> (codes [out, in] uint8 in 0..15,
    scale [out, in / 32] float32, zero [out, in / 32] float32) of `(q - 8) * scale + zero`."""
    out_features, groups = blocks.shape[0], in_features // GROUP
    head = 4 if kind == "Q4_1" else 2
    b = blocks.reshape(out_features, groups, head + 16)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = b[..., head:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out_features, -1)
    if kind == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)


def decode_q8_0(blocks: np.ndarray, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes [out, in / 32 * 34] -> (codes [out, in] int8, scale [out, in / 32]
    float32) of `q * scale`."""
    out_features, groups = blocks.shape[0], in_features // GROUP
    b = blocks.reshape(out_features, groups, 2 + GROUP)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(out_features, in_features)
    return torch.from_numpy(codes), torch.from_numpy(d)


def _checkpoint_name(gguf_name: str) -> tuple[str, str | None] | None:
    """(checkpoint name, the decoder part or None for the embedding / head) of a tensor we may
    read from blocks."""
    if gguf_name in _WHOLE:
        return _WHOLE[gguf_name], None
    match = _LAYER.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part = match.groups()
    return f"model.layers.{layer}.{_NAMES[part]}.weight", part


def _usable(part: str | None, kind: str, method: str) -> bool:
    """Whether a tensor of GGUF type `kind` loads as it is stored under `method` ("int8",
    "int4" in groups of 32, anything else: the embedding and head only)."""
    if part is None or method == "int8":
        return kind == "Q8_0"
    return method == "int4" and kind in ("Q4_0", "Q4_1")


def block_method(quant: WeightQuant | None) -> str | None:
    """What `--quantization` lets the loader read from blocks: None (nothing), "int8", "int4"
    (groups of 32) or "head" (another int4 group size: the Q8_0 embedding and head only)."""
    if quant is None:
        return None
    if quant.method == "int4" and quant.group_size != GROUP:
        return "head"
    return quant.method


@cache
def block_kinds(gguf: Path, method: str) -> dict[str, str]:
    """{checkpoint name: GGUF type} of the tensors `quantized_tensors` yields for `method`
    (read from the file's header only: what the loader and the memory plan count on)."""
    found: dict[str, str] = {}
    header = read_gguf_header(gguf)
    if header.architecture not in BLOCK_ARCHITECTURES:
        return found
    for tensor in header.tensors:
        named = _checkpoint_name(tensor.name)
        if named is not None and _usable(named[1], tensor.type_name, method):
            found[named[0]] = tensor.type_name
    return found


def quantized_tensors(
    gguf: Path, method: str, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
    """(checkpoint name, payload) of every tensor the file holds in blocks we compute with under
    `--quantization method`, rows in Hugging Face order: Q4_0 / Q4_1 (codes, scale, zero) for
    int4's decoder linears, Q8_0 (codes, scale) for int8's and for the embedding and head."""
    # NOTE: llama.cpp permutes q/k rows for its "llama" architecture only (Mistral is converted
    # as one); transformers undoes it for that architecture only, and so do we: a qwen2 file's
    # rows are stored in Hugging Face order
    header = read_gguf_header(gguf)
    arch = header.architecture
    permuted = arch == "llama"
    if arch not in BLOCK_ARCHITECTURES:
        return
    for tensor in header.tensors:
        named = _checkpoint_name(tensor.name)
        kind = tensor.type_name
        if named is None or not _usable(named[1], kind, method):
            continue
        name, part = named
        in_features = tensor.shape[0]  # GGUF lists the fastest dimension first
        blocks = np.asarray(header.tensor_bytes(tensor))
        payload: tuple[torch.Tensor, ...] = (
            decode_q8_0(blocks, in_features)
            if kind == "Q8_0"
            else decode_q4(blocks, kind, in_features)
        )
        if permuted and part in ("attn_q", "attn_k"):
            order = torch.from_numpy(
                _rope_rows(payload[0].shape[0], num_heads if part == "attn_q" else num_kv_heads)
            )
            payload = tuple(t[order] for t in payload)
        yield name, payload
