"""`pagedserve bench quant` end to end on a tiny model: every mode reports its memory, its
decode step times, its perplexity on the shipped text and its greedy agreement with fp32."""

from __future__ import annotations

import json
import math

from pagedserve.bench import quant


def test_the_quant_bench_reports_every_mode(tiny_llama, tmp_path, capsys):
    out = tmp_path / "quant.json"
    argv = ["--model", str(tiny_llama), "--modes", "fp32", "int8", "bf16-int4",
            "--batches", "1", "2", "--rounds", "1", "--steps", "1", "--new-tokens", "4",
            "--out", str(out)]  # fmt: skip
    assert quant.main(argv) == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert list(modes) == ["fp32", "int8", "bf16-int4-g32"]
    assert report["corpus_tokens"] > 1000
    fp32, int8, int4 = modes.values()
    assert fp32["greedy_same"] == 1.0 and fp32["greedy_prefix"] == 1.0  # the reference
    assert fp32["weight_bytes"] > int8["weight_bytes"] > int4["weight_bytes"]
    assert int4["kv_bytes_per_seq"] * 2 == fp32["kv_bytes_per_seq"]  # bf16 KV
    for entry in modes.values():
        assert math.isfinite(entry["perplexity"]) and entry["perplexity"] > 1
        assert 0 <= entry["greedy_same"] <= entry["greedy_prefix"] <= 1
        assert len(entry["step_ms_b1"]) == 1 and len(entry["step_ms_b2"]) == 1
    table = capsys.readouterr().out
    assert "| bf16-int4-g32 |" in table
