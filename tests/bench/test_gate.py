"""The correctness gate's near-tie policy (bench/gate.py): in bf16 a first difference where
transformers' top two logits are within a few ulps is forgiven and reported; a larger margin,
or any difference in fp32, fails the gate."""

from __future__ import annotations

import pytest
import torch

from pagedserve.bench import gate
from pagedserve.bench.workloads import BenchRequest


def logits_with(top: float, second: float) -> torch.Tensor:
    row = torch.full((8,), -10.0)
    row[3], row[5] = top, second  # token 3 is transformers' choice, 5 is ours
    return row


def test_a_bf16_near_tie_is_forgiven_and_a_clear_margin_is_not(monkeypatch):
    monkeypatch.setattr(gate, "DTYPE", "bfloat16")
    ulp = 2.0**-7 * 8  # bf16 spacing for values in [8, 16)
    assert gate.near_tie(logits_with(12.0, 12.0 - ulp), 3, 5) == pytest.approx(ulp)
    assert gate.near_tie(logits_with(12.0, 12.0 - 10 * ulp), 3, 5) is None
    monkeypatch.setattr(gate, "DTYPE", None)  # fp32: exact
    assert gate.near_tie(logits_with(12.0, 12.0 - 1e-6), 3, 5) is None


def test_check_reports_ties_and_fails_on_real_differences(monkeypatch):
    monkeypatch.setattr(gate, "DTYPE", "bfloat16")
    steps = torch.stack([logits_with(12.0, 11.0), logits_with(12.0, 11.99)])
    monkeypatch.setattr(gate, "hf_greedy_with_logits", lambda m, p, n: ([3, 3], steps[:n]))
    requests = [BenchRequest(f"r{i}", [1, 2], 2) for i in range(2)]
    tie = gate.check("model", requests, {"r0": [3, 5], "r1": [3, 3]}, sample=2, max_tokens=2)
    assert tie["passed"] and tie["near_ties"][0]["request_id"] == "r0"
    real = gate.check("model", requests, {"r0": [5, 3], "r1": [3, 3]}, sample=2, max_tokens=2)
    assert not real["passed"] and real["mismatches"] == [{"request_id": "r0", "first_diff": 0}]
