"""S14 samples (`pagedserve bench samples --quick`) on the tiny model: n = 8 against 8 separate
requests, in the scenario's own peer process. The gate (every sample equal to the single request
seeded sample_seed(seed, i), the samples distinct) passes and every ratio is reported. No timing
asserts (docs/benchmarks/method.md): tok/s ratios are only checked to exist."""

from __future__ import annotations

from pathlib import Path

from pagedserve.bench import report, scenarios_samples
from pagedserve.bench.driver import Context

METRICS = {
    "peak KV blocks: n=8 / 8 separate",
    "peak KV blocks n=8: measured / (prompt once + 8 x own)",
    "useful tok/s: n=8 / 8 separate",
    "computed prompt tokens: n=8 / 8 separate",
    "peak KV blocks: n=8 / 8 separate + prefix cache",
    "useful tok/s: n=8 / 8 separate + prefix cache",
    "computed prompt tokens: n=8 / 8 separate + prefix cache",
}


def test_samples_scenario_passes_its_gate_and_reports_every_ratio(tiny_llama: Path, tmp_path):
    ctx = Context(str(tiny_llama), "", 512, quick=True, reps=1, work=tmp_path)
    try:
        res = scenarios_samples.samples(ctx)
    finally:
        ctx.close()
    assert res.valid, res.gate
    assert res.gate["checked"] == 2 * 2 * 8  # 2 prompts x 8 samples, against 2 other modes
    ratios = {r.metric: r.values for r in res.ratios}
    assert set(ratios) == METRICS
    assert all(len(v) == 1 and v[0] > 0 for v in ratios.values())
    # the prompt computed once instead of 8 times; the peak is the block arithmetic exactly
    assert ratios["computed prompt tokens: n=8 / 8 separate"] == [1 / 8]
    assert ratios["peak KV blocks n=8: measured / (prompt once + 8 x own)"] == [1.0]
    assert ratios["peak KV blocks: n=8 / 8 separate"][0] < 0.25
    assert set(res.runs) == set(scenarios_samples.MODES)
    assert all(run[0]["preemptions"] == 0 for run in res.runs.values())
    header = {"date": "-", "command": "pagedserve bench samples --quick", "reps": 1}
    assert "| S14 samples | useful tok/s: n=8 / 8 separate |" in report.markdown([res], header)
