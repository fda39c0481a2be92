"""`pagedserve bench quant` end to end on a tiny model: every mode reports its memory, its
decode step times, its perplexity on the shipped text and its greedy agreement with fp32; an
8-bit KV mode also its sequences at a fixed KV budget and its decode-order perplexity, both
beside its base mode's."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedserve.bench import quant, quant_linear
from pagedserve.kernels import cpu_native


def test_the_quant_bench_reports_every_mode(tiny_llama, tmp_path, capsys):
    out = tmp_path / "quant.json"
    argv = ["--model", str(tiny_llama), "--modes", "fp32", "int8", "bf16-int4", "bf16+kv-int8",
            "--batches", "1", "2", "--rounds", "1", "--steps", "1", "--new-tokens", "4",
            "--decode-tokens", "24", "--out", str(out)]  # fmt: skip
    assert quant.main(argv) == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["fp32", "int8", "bf16-int4-g32", "bf16+kv-int8"]
    assert report["corpus_tokens"] > 1000
    fp32, int8, int4, kv8 = modes.values()
    # bf16 pages are 2 bytes per element, int8 ones 1 plus a float32 per block, layer and head
    assert 1.9 < kv8["kv_budget_seqs_vs_base"] <= 2.0
    assert kv8["kv_budget_seqs"] > fp32["kv_budget_seqs"] * 3.8
    for key in ("perplexity", "base_perplexity", "decode_perplexity", "base_decode_perplexity"):
        assert math.isfinite(kv8[key]) and kv8[key] > 1, key
    assert "decode_perplexity" not in fp32
    assert fp32["greedy_same"] == 1.0 and fp32["greedy_prefix"] == 1.0  # the reference
    assert fp32["weight_bytes"] > int8["weight_bytes"] > int4["weight_bytes"]
    assert int4["kv_bytes_per_seq"] * 2 == fp32["kv_bytes_per_seq"]  # bf16 KV
    for entry in modes.values():
        assert math.isfinite(entry["perplexity"]) and entry["perplexity"] > 1
        assert 0 <= entry["greedy_same"] <= entry["greedy_prefix"] <= 1
        assert len(entry["step_ms_b1"]) == 1 and len(entry["step_ms_b2"]) == 1
    table = capsys.readouterr().out
    assert "| bf16-int4-g32 |" in table and "| bf16+kv-int8 |" in table


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native kernel here")
def test_the_int4_linear_bench_times_the_kernel_on_the_layers_own_operands(capsys):
    # NOTE: the kernel column calls linear_i4g.c through bound ctypes arguments; they must be
    # the layer's own (codes, pairs, group), or the bench times something else
    layers = quant_linear.make_layers(1, 32)
    xs = {k: torch.randn(2, k) for _, k in quant_linear.SMOLLM2}
    ys = {n: torch.full((2, n), float("nan")) for n, _ in quant_linear.SMOLLM2}
    for q in layers:
        quant_linear.kernel_calls([q], xs, ys)()
        assert torch.equal(ys[q.out_features], q(xs[q.in_features]))
    quant_linear.main(["--layers", "1", "--rows", "1", "--repeats", "1"])
    table = capsys.readouterr().out
    assert "| rows | kernel ms | GB/s | through QuantizedLinear ms |" in table
    assert table.count("\n| 1 | ") == 1
