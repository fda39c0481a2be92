"""Linear weights straight from a GGUF file's 4-bit blocks (`--quantization int4`, group 32).

A model converted from GGUF (`pagedserve fetch-model`, `--model FILE.gguf`) is an fp32 Hugging
Face directory whose `pagedserve-source.json` names the GGUF it came from. With int4 weights in
groups of 32, the loader takes every decoder linear layer stored as Q4_0 or Q4_1 from the GGUF's
blocks instead (`QuantizedLinear.load_int4`): the file's own codes and scales, never
dequantized to fp32 and quantized again.

    Q4_0 block (18 bytes, 32 weights): d fp16, 16 bytes of codes   w = d * (q - 8)
    Q4_1 block (20 bytes, 32 weights): d fp16, m fp16, 16 bytes    w = d * q + m
    codes: byte j holds weight j (low nibble) and weight j + 16 (high nibble)

In ATen's packed int4 format (`w = (q - 8) * scale + zero`) that is scale = d and zero = 0
(Q4_0) or m + 8 d (Q4_1). llama.cpp stores q and k rows permuted for its rotary layout;
transformers' GGUF loader undoes it, and so do we (the same row permutation of the codes).
Other tensor types (F32, F16, Q8_0, K-quants) load from the safetensors as before.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedserve.fetch_model import SOURCE_FILE, known_gguf

log = logging.getLogger(__name__)

GROUP = 32  # weights per Q4 block
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


def q4_linears(
    gguf: Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """(checkpoint name, (codes, scale, zero)) of every decoder linear the file holds as Q4_0 or
    Q4_1, rows in Hugging Face order."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    for tensor in reader.tensors:
        match = _LAYER.fullmatch(tensor.name)
        kind = tensor.tensor_type.name
        if match is None or kind not in ("Q4_0", "Q4_1"):
            continue
        in_features = int(tensor.shape[0])  # GGUF lists the fastest dimension first
        codes, scale, zero = decode_q4(np.asarray(tensor.data), kind, in_features)
        layer, part = match.groups()
        if part in ("attn_q", "attn_k"):
            order = torch.from_numpy(
                _rope_rows(codes.shape[0], num_heads if part == "attn_q" else num_kv_heads)
            )
            codes, scale, zero = codes[order], scale[order], zero[order]
        yield f"model.layers.{layer}.{_NAMES[part]}.weight", (codes, scale, zero)
