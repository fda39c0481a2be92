"""S16 multi-turn chat (`pagedserve bench online --workload multiturn`, docs/benchmarks/
method.md): every server in turn, started as S15 starts it (online_servers.py), driven by
`conversations` concurrent chats of `turns` turns each (multiturn.py), stopped; the report
compares the TTFT of turns 2 and later, where a prefix cache can serve the earlier turns, with
turn 1's, and every server with each of ours measured in the same run.

Every server gets the same total KV budget: ours `--kv-cache-memory` for the decode worker
and `--prefill-kv-cache-memory` for the prefill worker, vLLM-CPU (one engine) their sum,
which the conversations' total KV is meant to exceed (the report gives both); `pagedserve-tier` adds
the host prefix tier (`--kv-offload-memory` per worker). The goal (issue 45): turns >= 2 TTFT
p50 of ours <= 0.5 x vLLM-CPU's with prefix caching.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.bench import multiturn, online_servers
from pagedserve.bench.conversations import SYSTEM_PROMPT, ConversationSpec, user_messages
from pagedserve.bench.multiturn import ServerRun
from pagedserve.cli_options import bytes_arg

GOAL = 0.5  # ours' TTFT p50 of turns >= 2 over vLLM-CPU's, at most
# ours ÷ peer: (ServerRun field, label, higher is better)
METRICS = (
    ("ttft_first_p50_ms", "TTFT p50 turn 1", False),
    ("ttft_later_p50_ms", "TTFT p50 turns >= 2", False),
    ("ttft_later_p99_ms", "TTFT p99 turns >= 2", False),
    ("itl_p50_ms", "ITL p50", False),
    ("output_tok_s", "output tok/s", True),
)
DEFAULT_SERVERS = (online_servers.OURS, online_servers.OURS_TIER, online_servers.VLLM)
TEMPLATE_TOKENS = 16  # a chat template's tokens around one message, at most (a bound)


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    servers: tuple[str, ...]
    spec: ConversationSpec
    setup: online_servers.ServerSetup
    start_timeout_s: float
    out: Path
    raw: Path


@dataclass(frozen=True, slots=True)
class Ratio:
    ours: str
    peer: str
    metric: str
    value: float
    higher_is_better: bool


@dataclass(frozen=True, slots=True)
class MultiTurnResult:
    runs: tuple[ServerRun, ...]
    ratios: tuple[Ratio, ...]
    notes: tuple[str, ...]


def max_model_len(spec: ConversationSpec, encode: Callable[[str], list[int]]) -> int:
    """A bound on a conversation's longest sequence (its last prompt and answer, a template's
    tokens around every message), rounded up to 256: vLLM's --max-model-len, llama.cpp's
    context per slot."""
    messages = (spec.first_tokens + 2 * spec.first_stdev
                + (spec.turns - 1) * (spec.followup_tokens + 2 * spec.followup_stdev))  # fmt: skip
    answers = spec.turns * spec.output_tokens
    template = (2 * spec.turns + 1) * TEMPLATE_TOKENS
    longest = len(encode(SYSTEM_PROMPT)) + messages + answers + template
    return -(-longest // 256) * 256


def kv_bytes_per_token(model: str) -> int:
    """fp32 K and V of one token over every layer of the model at `model` (its config.json)."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * 4


def run(config: MultiTurnConfig, users: Sequence[Sequence[str]]) -> MultiTurnResult:
    """Every server of `config` in turn, each stopped before the next starts; one that is
    missing or fails to start is a note and a failed run, not an exception."""
    config.raw.mkdir(parents=True, exist_ok=True)
    runs: list[ServerRun] = []
    notes: list[str] = []
    for name in config.servers:
        why = online_servers.missing(name, config.setup)
        if why:
            print(f"[s16] {name}: skipped: {why}", flush=True)
            notes.append(f"{name}: skipped: {why}")
            continue
        try:
            runs.append(_serve_and_drive(config, name, users))
        except (RuntimeError, OSError, ValueError) as err:
            print(f"[s16] {name}: failed: {err}", flush=True)
            runs.append(multiturn.failed(name, config.spec, str(err)))
            notes.append(f"{name}: failed: {str(err)[:500]}")
    notes += [f"{r.server}: {r.errored} turns errored ({'; '.join(r.errors)}), "
              f"{r.not_sent} not sent; no ratio" for r in runs if r.errored]  # fmt: skip
    return MultiTurnResult(tuple(runs), tuple(ratios(runs)), tuple(notes))


def _serve_and_drive(config: MultiTurnConfig, name: str,
                     users: Sequence[Sequence[str]]) -> ServerRun:  # fmt: skip
    port = online_servers.free_port()
    print(f"[s16] {name}: starting on port {port}", flush=True)
    setup = config.setup
    if name == online_servers.VLLM:  # NOTE: one engine gets what our workers get together
        setup = dataclasses.replace(setup, kv_cache_memory_bytes=vllm_budget(setup))
    spec = online_servers.launch(name, setup, port)
    server = online_servers.start(spec, config.setup.log_dir, config.start_timeout_s)
    try:
        online_servers.warm_up(server, multiturn.CHAT)
        return measure(name, server.base_url, server.model, config.spec, users, config.raw,
                       server=server)  # fmt: skip
    finally:
        online_servers.stop(server)


def measure(name: str, base_url: str, model: str, spec: ConversationSpec,
            users: Sequence[Sequence[str]], raw: Path,
            server: online_servers.Server | None = None) -> ServerRun:  # fmt: skip
    """Drive one running server at `base_url`; every turn's record (the transcript: answers,
    token counts) goes to `raw`/<name>-multiturn.json. With `server`, the run holds the CPU
    seconds its processes spent meanwhile."""
    print(f"[s16] {name}: {spec.conversations} conversations x {spec.turns} turns", flush=True)
    before = online_servers.cpu_seconds(server) if server else {}
    records = multiturn.drive(base_url, model, spec, users,
                              lambda line: print(f"[s16] {name} {line}", flush=True))  # fmt: skip
    after = online_servers.cpu_seconds(server) if server else {}
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{name}-multiturn.json").write_text(
        json.dumps([dataclasses.asdict(r) for r in records], indent=1)
    )
    result = multiturn.summarise(name, spec, records)
    cpu = {role: after[role] - before.get(role, 0.0) for role in after}
    print(f"[s16] {name}: TTFT p50 turn 1 {_fmt(result.ttft_first_p50_ms)} ms, turns >= 2 "
          f"{_fmt(result.ttft_later_p50_ms)} ms, ITL p50 {_fmt(result.itl_p50_ms)} ms, "
          f"{result.output_tok_s:.1f} tok/s, {result.completed} completed, "
          f"{result.errored} errored", flush=True)  # fmt: skip
    return dataclasses.replace(result, cpu_s=cpu)


def ratios(runs: Sequence[ServerRun]) -> list[Ratio]:
    """Each of ours (pagedserve, pagedserve-tier) ÷ every other server that ran cleanly, for
    every metric both have."""
    out = []
    clean = [r for r in runs if r.clean]
    for mine in (r for r in clean if r.server in online_servers.OURS_ALL):
        for other in (r for r in clean if r is not mine):
            for field, label, higher in METRICS:
                a, b = getattr(mine, field), getattr(other, field)
                if a is not None and b:
                    out.append(Ratio(mine.server, other.server, label, a / b, higher))
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown(config: MultiTurnConfig, result: MultiTurnResult, header: dict) -> str:
    """results.md: the workload, every server's run, TTFT by turn, the ratios, the notes."""
    s = config.spec
    lines = [
        f"# S16 multi-turn chat: {Path(config.setup.model).name}, {config.setup.mode}", "",
        f"Run {header['date']} - `{header['command']}` - {header['cpus']} CPUs", "",
        f"{s.conversations} conversations at once (one stream each) x {s.turns} turns, "
        f"`{multiturn.CHAT}` streamed; a system prompt, a first user message of "
        f"{s.first_tokens} ± {s.first_stdev} tokens, follow-ups of {s.followup_tokens} ± "
        f"{s.followup_stdev}, {s.output_tokens} output tokens per turn (`ignore_eos`, greedy); "
        "each turn carries every earlier message and the server's own earlier answers.", "",
        "| server | TTFT p50 turn 1 ms | TTFT p99 turn 1 ms | TTFT p50 turns >= 2 ms "
        "| TTFT p99 turns >= 2 ms | turns >= 2 ÷ turn 1 (p50) | ITL p50 ms | ITL p99 ms "
        "| output tok/s | completed | errored | not sent | cached share turns >= 2 "
        "| wall s | server CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in result.runs:
        cached = "-" if r.cached_share_later is None else f"{100 * r.cached_share_later:.0f} %"
        cpu = ", ".join(f"{k} {_fmt(v)}" for k, v in r.cpu_s.items()) or "-"
        cells = [r.server, *(_fmt(x) for x in (r.ttft_first_p50_ms, r.ttft_first_p99_ms,
                 r.ttft_later_p50_ms, r.ttft_later_p99_ms, r.later_over_first, r.itl_p50_ms,
                 r.itl_p99_ms, r.output_tok_s)), r.completed, r.errored, r.not_sent, cached,
                 _fmt(r.wall_s), cpu]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    turns = range(1, s.turns + 1)
    lines += ["", "TTFT p50 by turn, ms (mean prompt tokens as the server counted them):", "",
              "| server | " + " | ".join(f"turn {t}" for t in turns) + " |",
              "|---|" + "---|" * s.turns]  # fmt: skip
    for r in result.runs:
        per_turn = [f"{_fmt(t)} ({_fmt(p)})" for t, p in
                    zip(r.ttft_p50_by_turn_ms, r.prompt_tokens_by_turn, strict=True)]  # fmt: skip
        lines.append(f"| {r.server} | " + " | ".join(per_turn) + " |")
    lines += ["", *_ratio_table(result.ratios), "", *_goal(result.ratios), ""]
    lines += [f"- {note}" for note in (*header["fixed_notes"], *result.notes)]
    return "\n".join(lines) + "\n"


def _ratio_table(rs: Sequence[Ratio]) -> list[str]:
    labels = [label for _, label, _ in METRICS]
    lines = ["Ratios, ours ÷ peer in this run (tok/s: higher is better for ours; TTFT and "
             "ITL: lower is better):", "",
             "| ours | peer | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]  # fmt: skip
    pairs = dict.fromkeys((r.ours, r.peer) for r in rs)
    for ours, peer in pairs:
        got = {r.metric: r.value for r in rs if (r.ours, r.peer) == (ours, peer)}
        lines.append(f"| {ours} | {peer} | " + " | ".join(_fmt(got.get(x)) for x in labels) + " |")
    return lines if pairs else ["No ratios: no peer ran cleanly beside ours."]


def _goal(rs: Sequence[Ratio]) -> list[str]:
    """Issue 45's goal, per server of ours that ran beside vLLM-CPU."""
    out = []
    for r in rs:
        if r.peer == online_servers.VLLM and r.metric == "TTFT p50 turns >= 2":
            met = "met" if r.value <= GOAL else "not met"
            out.append(f"Goal, turns >= 2 TTFT p50 <= {GOAL} x vLLM-CPU's: {r.ours} "
                       f"{_fmt(r.value)} x, {met}.")  # fmt: skip
    return out or [f"Goal (turns >= 2 TTFT p50 <= {GOAL} x vLLM-CPU's): not measured, "
                   "vLLM-CPU did not run cleanly beside ours."]  # fmt: skip


def vllm_budget(setup: online_servers.ServerSetup) -> int:
    """vLLM-CPU's KV bytes: the total of our prefill and decode workers'."""
    decode, prefill = setup.kv_cache_memory_bytes, setup.prefill_kv_cache_memory_bytes
    return decode + (decode if prefill is None else prefill)


def fixed_notes(config: MultiTurnConfig, result: MultiTurnResult) -> list[str]:
    """The budgets every server got, and the conversations' total KV against them."""
    setup, per_token = config.setup, kv_bytes_per_token(config.setup.model)
    budget = setup.kv_cache_memory_bytes
    notes = [
        f"KV budgets: pagedserve and pagedserve-tier {_mib(budget)} for the decode worker, "
        f"{_mib(vllm_budget(setup) - budget)} for the prefill worker; pagedserve-tier's host "
        f"prefix tier {_mib(setup.kv_offload_memory_bytes)} "
        f"per worker; vLLM-CPU `--kv-cache-memory-bytes` {_mib(vllm_budget(setup))} (one "
        "engine: our workers' total), "
        f"`--max-model-len` {setup.max_model_len}, prefix caching on; llama.cpp (when run) -c "
        f"{setup.max_model_len} tokens per slot x {setup.max_streams} slots, "
        f"{_mib(per_token * (setup.max_model_len or 0) * setup.max_streams)} of F32 KV, its "
        "slots' prompt caching.",
    ]
    for r in result.runs:
        if r.final_context_tokens:
            total = r.final_context_tokens * per_token
            notes.append(f"{r.server}: the conversations' total KV {r.final_context_tokens} "
                         f"tokens ({_mib(total)} fp32, {total / vllm_budget(setup):.2g} x "
                         "the total KV budget).")  # fmt: skip
    notes.append("Prompt tokens are each server's count, its chat template's included; the "
                 "answers carried into later turns are each server's own (greedy).")  # fmt: skip
    return notes


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def write(config: MultiTurnConfig, result: MultiTurnResult, argv: Sequence[str]) -> list[Path]:
    """results.md and summary.json into `config.out`. Returns the paths written."""
    header = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "pagedserve bench online " + shlex.join(argv), "cpus": os.cpu_count(),
        "fixed_notes": fixed_notes(config, result),
    }  # fmt: skip
    config.out.mkdir(parents=True, exist_ok=True)
    summary = {**header, "scenario": "S16 multi-turn", "config": dataclasses.asdict(config),
               **dataclasses.asdict(result)}  # fmt: skip
    paths = [config.out / "results.md", config.out / "summary.json"]
    paths[0].write_text(markdown(config, result, header))
    paths[1].write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return paths


def encoder(model: str) -> Callable[[str], list[int]]:
    """`model`'s tokenizer as text -> ids, without special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def main(config: MultiTurnConfig, argv: Sequence[str]) -> int:
    """0 when every server of ours ran every turn cleanly, 1 otherwise."""
    users = user_messages(config.spec, encoder(config.setup.model))
    result = run(config, users)
    print("\n".join(str(p) for p in write(config, result, argv)))
    ours = [r for r in result.runs if r.server in online_servers.OURS_ALL]
    return 0 if ours and all(r.clean and not r.not_sent for r in ours) else 1


# S15's flags that mean nothing here: refused when given (their parser defaults are None)
LEVEL_FLAGS = {"streams": "--streams", "seconds": "--seconds", "warmup": "--warmup",
               "prompt_tokens": "--prompt-tokens", "prompt_stdev": "--prompt-stdev"}  # fmt: skip


def add_multiturn_arguments(p: argparse.ArgumentParser) -> None:
    """S16's flags of `pagedserve bench online`."""
    g = p.add_argument_group("multiturn (S16)")
    g.add_argument("--conversations", type=int, default=16, help="chats at once, one stream each")
    g.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    g.add_argument("--first-message-tokens", type=int, default=160,
                   help="a conversation's first user message, mean tokens")  # fmt: skip
    g.add_argument("--first-message-stdev", type=int, default=16)
    g.add_argument("--followup-tokens", type=int, default=48,
                   help="every later user message, mean tokens")  # fmt: skip
    g.add_argument("--followup-stdev", type=int, default=8)
    g.add_argument("--conversation-seed", type=int, default=0, help="the messages' seed")
    g.add_argument("--kv-offload-memory", type=bytes_arg, default="1GiB",
                   help="pagedserve-tier's host prefix tier, per worker")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> MultiTurnConfig:
    """ValueError, naming the flag, for a missing model, a flag S16 cannot honour, or
    conversations that cannot be built."""
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"model: no model directory {args.model} (`make real-model`)")
    if importlib.util.find_spec("httpx") is None:
        raise ValueError("--workload multiturn: needs httpx (`pip install httpx`, or the dev "
                         "extras)")  # fmt: skip
    given = [flag for key, flag in LEVEL_FLAGS.items() if getattr(args, key) is not None]
    if args.repeat != 1:
        given.append("--repeat")
    if args.endpoint != "chat" or args.no_grpc:
        given.append("--endpoint" if args.endpoint != "chat" else "--no-grpc")
    if given:
        raise ValueError(f"{', '.join(given)}: not used by --workload multiturn (its load is "
                         "--conversations x --turns on /v1/chat/completions)")  # fmt: skip
    spec = ConversationSpec(
        args.conversations, args.turns, args.first_message_tokens, args.first_message_stdev,
        args.followup_tokens, args.followup_stdev,
        48 if args.output_tokens is None else args.output_tokens, args.conversation_seed,
    )  # fmt: skip
    mode = online_servers.mode_of(args.quantization, args.dtype)
    default = f"{datetime.date.today()}-s16-{Path(args.model).name}-{mode}"
    out = Path(args.out or f"docs/benchmarks/{default}")
    raw = Path(args.raw or Path(".cache/bench") / out.resolve().name)
    setup = online_servers.ServerSetup(
        args.model, mode, Path(args.peers_venv), Path(args.llama_cpp_bin), args.gguf_source,
        Path(args.gguf_dir), args.kv_cache_memory or bytes_arg("448MiB"), spec.conversations,
        args.threads, raw / "logs", args.kv_offload_memory,
        max_model_len=max_model_len(spec, encoder(args.model)),
        prefill_kv_cache_memory_bytes=args.prefill_kv_cache_memory or bytes_arg("64MiB"),
    )  # fmt: skip
    servers = args.servers or DEFAULT_SERVERS
    return MultiTurnConfig(tuple(dict.fromkeys(servers)), spec, setup, args.start_timeout,
                           out, raw)  # fmt: skip
