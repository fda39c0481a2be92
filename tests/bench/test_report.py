"""Report files: results.md and summary.json in the report folder (committed), the raw
per-request data in raw.json elsewhere (docs/benchmarks/README.md, "Report files")."""

from __future__ import annotations

import json

from pagedserve.bench import report
from pagedserve.bench.driver import Ratio, ScenarioResult


def make_result() -> ScenarioResult:
    run = {
        "useful_tok_s": 12.5,
        "ttft": {"p50": 0.1, "p99": 0.3},
        "requests": [{"request_id": "r0", "ttft": 0.1, "itl": [0.01, 0.02]}],
        "kv": {"peak_blocks": 7, "timeline": [[0.0, 1, 2], [0.5, 3, 4]]},
    }
    return ScenarioResult(
        "S5 shared-prefix-memory",
        ratios=[Ratio("S5", "copies", [1.0], goal="1")],
        gate={"passed": True, "checked": ["r0"]},
        runs={"engine": [run]},
    )


def test_summary_drops_per_request_records_and_timelines_at_any_depth_and_keeps_aggregates():
    data = {"probes": {"cpus": 2}, "scenarios": [make_result().to_json()]}
    summary = report.summary(data)
    (run,) = summary["scenarios"][0]["runs"]["engine"]
    assert run == {"useful_tok_s": 12.5, "ttft": {"p50": 0.1, "p99": 0.3}, "kv": {"peak_blocks": 7}}
    assert summary["probes"] == {"cpus": 2}
    assert summary["scenarios"][0]["ratios"][0]["median"] == 1.0
    assert "requests" in data["scenarios"][0]["runs"]["engine"][0]  # the input is unchanged


def test_write_puts_the_summary_beside_results_md_and_the_raw_data_in_the_raw_folder(tmp_path):
    out, raw = tmp_path / "report", tmp_path / "raw"
    header = {"date": "2026-12-04 10:00 UTC", "command": "pagedserve bench x", "reps": 1}
    paths = report.write([make_result()], header, out, raw)
    assert sorted(p.name for p in paths) == ["raw.json", "results.md", "summary.json"]
    assert sorted(p.name for p in out.iterdir()) == ["results.md", "summary.json"]
    full = json.loads((raw / "raw.json").read_text())
    assert full["scenarios"][0]["runs"]["engine"][0]["requests"][0]["request_id"] == "r0"
    summary = json.loads((out / "summary.json").read_text())
    assert summary == report.summary(full) and summary["date"] == header["date"]
    assert "| S5 shared-prefix-memory | copies |" in (out / "results.md").read_text()


def test_write_without_a_raw_folder_writes_no_raw_data(tmp_path):
    paths = report.write([make_result()], {"date": "d", "command": "c", "reps": 1}, tmp_path)
    assert sorted(p.name for p in paths) == ["results.md", "summary.json"]
