"""`pagedserve bench` end to end on a tiny model (shared-prefix-memory, concurrency): reports exist,
parse, and the correctness gate passed. No timing asserts (docs/benchmarks/method.md: speed is
measured, not tested)."""

from __future__ import annotations

import json
import pathlib

import pytest

from pagedserve.bench import report, suite


def run_quick(tmp_path, scenario: str) -> dict:
    """`pagedserve bench SCENARIO --quick --reps 1`; its exit status must be 0; summary.json."""
    out, raw = tmp_path / "report", tmp_path / "raw"
    argv = ["--quick", "--reps", "1", "--out", str(out), "--raw", str(raw)]
    rc = suite.main([scenario, *argv, "--work", str(tmp_path / "work")])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert not (out / "raw.json").exists() and not (out / "results.json").exists()
    assert report.summary(json.loads((raw / "raw.json").read_text())) == summary
    return summary


def test_shared_prefix_scenario_writes_valid_reports_and_passes_the_gate(tmp_path):
    data = run_quick(tmp_path, "shared-prefix-memory")
    out = tmp_path / "report"
    (scenario,) = data["scenarios"]
    assert scenario["valid"] and scenario["gate"]["passed"]
    assert len(scenario["gate"]["checked"]) == 3
    copies = next(r for r in scenario["ratios"] if r["metric"].startswith("copies"))
    assert copies["values"] == [1.0]  # 10 requests share one copy of the 500-token prefix
    assert "| S5 shared-prefix-memory |" in (out / "results.md").read_text()
    assert data["probes"]["memory"]["copy_GBps"] > 0


def test_concurrency_scenario_completes_every_stream_and_reports_each_process(tmp_path):
    (scenario,) = run_quick(tmp_path, "concurrency")["scenarios"]
    assert scenario["valid"]
    for level in ("streams=10", "streams=100"):
        run = scenario["runs"][level]
        assert run["completed"] == run["streams"] and run["failed"] == 0
        assert run["health_s"]["samples"] > 0 and run["health_s"]["failures"] == 0
        assert set(run["processes"]) == {"router", "prefill-0", "decode-0"}
        for stats in run["processes"].values():
            assert stats["peak"]["threads"] >= stats["start"]["threads"] > 0
            assert stats["peak"]["rss_mib"] > 0


def test_gateway_scenario_compares_http_with_grpc_on_the_same_requests(tmp_path):
    (scenario,) = run_quick(tmp_path, "gateway")["scenarios"]
    assert scenario["valid"] and not scenario["notes"]  # every HTTP text = the gRPC text
    assert {r["metric"] for r in scenario["ratios"]} == {
        "gateway / gRPC useful tok/s (16 at once)", "gateway / gRPC TTFT p50 (one at a time)"
    }  # fmt: skip
    for ratio in scenario["ratios"]:
        assert len(ratio["values"]) == 1 and ratio["values"][0] > 0
    assert set(scenario["runs"]) == {"rep=0", "rep=0 one at a time"}


@pytest.mark.parametrize("flags", [[], ["--dtype", "bfloat16"], ["--quantization", "int8"]])
def test_decode_step_runs_every_arm_and_restores_the_kernels(capsys, flags):
    from pagedserve.cli import main as cli
    from pagedserve.kernels import cpu_native
    from pagedserve.model import native_stack

    rc = cli(["bench", "decode-step", "--batches", "2", "--rounds", "1", "--steps", "2", *flags])
    printed = capsys.readouterr().out
    if cpu_native.unavailable_reason() is not None:
        assert rc == 1 and "unavailable" in printed
        return
    assert rc == 0
    row = next(line for line in printed.splitlines() if line.startswith("| 2 |"))
    torch_ms, native_ms, stack_ms = (float(cell) for cell in row.split("|")[2:5])
    assert torch_ms > 0 and native_ms > 0 and stack_ms > 0
    assert cpu_native.enabled and native_stack.enabled  # left on for whatever runs next


def test_decode_step_per_family_shows_which_families_the_native_stack_takes(capsys):
    from pagedserve.cli import main as cli
    from pagedserve.kernels import cpu_native

    rc = cli(["bench", "decode-step", "--families", "llama", "qwen3", "--batches", "2",
              "--rounds", "1", "--steps", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    if cpu_native.unavailable_reason() is not None:
        assert rc == 1
        return
    assert rc == 0
    rows = {line.split("|")[1].strip(): line.split("|") for line in printed.splitlines()
            if line.startswith(("| llama |", "| qwen3 |"))}  # fmt: skip
    assert rows["llama"][-2].strip() == "yes"  # Llama's layer: the one-call native stack
    assert rows["qwen3"][-2].strip() == "declined"  # q/k norms: the layer-by-layer path
    assert all(float(row[3]) > 0 for row in rows.values())


def test_grpc_messages_reads_every_message_both_ways_and_stops_its_server(capsys):
    from pagedserve.cli import main as cli

    rc = cli(["bench", "grpc-messages", "--requests", "3", "--steps", "4", "--period-ms", "1",
              "--reps", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0
    # NOTE: the bench itself asserts that each way delivered requests x steps DecodeResponses
    rows = [line for line in printed.splitlines() if line.startswith("| one stream")]
    assert len(rows) == 2
    for row in rows:
        server, client, both = (float(cell.split()[0]) for cell in row.split("|")[2:5])
        assert server > 0 and client > 0 and both > 0
    assert not [p for p in pathlib.Path("/proc").glob("[0-9]*/cmdline") if _serves(p)]


def _serves(cmdline: pathlib.Path) -> bool:
    try:
        return b"grpc_messages\x00--serve" in cmdline.read_bytes()
    except OSError:
        return False  # NOTE: the process ended meanwhile


def test_structured_bench_times_both_arms_with_no_request_finished(capsys):
    from pagedserve.cli import main as cli

    assert cli(["bench", "structured", "--batches", "2", "--rounds", "1", "--steps", "2"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |"))
    plain_ms, schema_ms = (float(cell) for cell in row.split("|")[2:4])
    assert plain_ms > 0 and schema_ms > 0
