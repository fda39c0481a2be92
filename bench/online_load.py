"""S15's load (docs/benchmarks/method.md): guidellm against one server's OpenAI API, and the
same closed loop straight over gRPC to our router and through our gateway by a light HTTP
client, each level reduced to one `Level`.

guidellm (`guidellm run -c scenario.json`, one process per concurrency level, so that a run
that stalls, as one in a few dozen does at start-up on a busy machine, is retried alone) keeps
`streams` requests in flight for `seconds`, synthetic prompts of `prompt_tokens` ±
`prompt_stdev` tokens (by the model's own tokenizer, seeded by the level: no prompt repeats
across levels, so no prefix cache is warmed by an earlier level) and exactly `output_tokens`
tokens out (guidellm sends `ignore_eos`). Its JSON is kept.

Output tok/s is a windowed token rate, not a count of finished requests: every output token
that arrives inside the measurement window [start + warmup, end], from finished and unfinished
requests alike, divided by the window's length (guidellm's own
`output_tokens_per_second.total`, the rate of its per-iteration token timestamps clipped to
that window). A level of 60 s at 64 streams finishes barely one request per stream; counting
only finished requests (guidellm's `successful`) turned every server's rate into
completions × 96 / 60 (47 and 64 completions: 75.2 and 102.4 tok/s in the first S15 report).
The first `warmup_s` seconds (guidellm's `warmup`, by duration) are left out of every metric:
all streams start together and the first wave is one prefill burst, not the steady state.

The gRPC loop uses the same definitions: the same window and warmup, output tok/s counts every
token whose message arrives inside the window, TTFT is the first token's arrival after the
send, ITL is (last token - first token) / (tokens - 1) per finished request, and a request
still running at the end is incomplete (cancelled by its deadline), not an error. TTFT and ITL
percentiles are over finished requests that ended inside the window, as guidellm's are.

The HTTP loop is the gRPC loop's load sent to our gateway's `/v1/completions` (the same token
ids as the prompt) by `http.client` threads. guidellm spends far more CPU than our servers'
own front ends (~17 CPU s a minute at 16 streams against ~1.5 for the gateway) on a machine
whose cores the decode worker keeps busy, so guidellm-HTTP ÷ gRPC holds the load generator's
cost; HTTP loop ÷ gRPC is the gateway's own share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc

from pagedserve.bench.grounded import guidellm_data
from pagedserve.client import Client
from pagedserve.sampling_params import SamplingParams

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
GROUNDED_PROMPTS = 512  # a level's grounded prompts (guidellm cycles through them)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """What every server is driven with, at each of `streams` in turn."""

    streams: tuple[int, ...]
    seconds: float  # per level
    prompt_tokens: int
    prompt_stdev: int
    output_tokens: int
    endpoint: str  # a key of ENDPOINTS
    tokenizer: str  # model directory whose tokenizer sizes the synthetic prompts
    guidellm: Path
    warmup_s: float = 0.0  # left out of every metric at the start of each level
    # "random": guidellm's synthetic prompts; "grounded": prompts whose answer repeats a
    # passage they hold (bench/grounded.py, S17), greedy (temperature 0) for every server
    workload: str = "random"

    @property
    def prompt_range(self) -> tuple[int, int]:
        """The shortest and longest prompt: the mean ± 2 standard deviations."""
        low = max(1, self.prompt_tokens - 2 * self.prompt_stdev)
        return low, self.prompt_tokens + 2 * self.prompt_stdev


@dataclasses.dataclass(frozen=True, slots=True)
class Level:
    """One server at one concurrency. Latencies in ms, None where nothing completed. `failure`:
    why the load generator produced no result (then every count is 0)."""

    server: str
    api: str  # "http" (guidellm), "grpc" or "http-loop" (ours, light, through the gateway)
    streams: int
    seconds: float
    output_tok_s: float
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    completed: int
    errored: int
    incomplete: int
    errors: tuple[str, ...] = ()  # distinct error messages, at most 5
    failure: str = ""
    repetition: int = 0  # of this level (`--repeat`), HTTP and gRPC alternating
    # CPU seconds of the server's processes during the level (ours by role: router, gateway,
    # prefill, decode; a peer as "server"), warmup included
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # CPU seconds of the load generator during the level: guidellm's processes, or the bench
    # process running our own loops (it shares the machine's cores with the server)
    client_cpu_s: float | None = None
    # per completed request, as the server counted them (chat: with its template's tokens)
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None

    @property
    def clean(self) -> bool:
        """Usable for a ratio: it ran, none errored, and output arrived (completed requests,
        or tokens of unfinished ones: at 64 streams a 60 s level can end before the first
        request does, and its rate still counts; its latencies are then None and get no
        ratio)."""
        return (
            not self.failure and self.errored == 0 and (self.completed > 0 or self.output_tok_s > 0)
        )


def scenario(load: LoadSpec, base_url: str, model: str, streams: int, rep: int = 0) -> dict:
    """guidellm 0.8.1's scenario file for repetition `rep` of one level."""
    low, high = load.prompt_range
    seed = streams + 1_000 * rep  # NOTE: new prompts at each level and repetition
    data: dict[str, object] = {"kind": "synthetic_text", "prompt_tokens": load.prompt_tokens,
            "prompt_tokens_stdev": load.prompt_stdev, "prompt_tokens_min": low,
            "prompt_tokens_max": high, "output_tokens": load.output_tokens}  # fmt: skip
    backend: dict[str, object] = {"kind": "openai_http", "target": base_url, "model": model,
                                  "request_format": ENDPOINTS[load.endpoint]}  # fmt: skip
    if load.workload == "grounded":
        data = guidellm_data(GROUNDED_PROMPTS, seed, load.output_tokens)
        backend["extras"] = {"body": {"temperature": 0.0}}
    profile = {"kind": "concurrent", "warmup": {"value": load.warmup_s, "mode": "duration"}}
    spec = {"backend": backend, "profile": profile, "data": [data],
            "seed": {"kind": "static", "value": seed},
            "constraints": [{"kind": "max_duration", "seconds": load.seconds}]}  # fmt: skip
    return {"spec": spec, "benchmarks": [{"profile.streams": streams}]}


def http_level(load: LoadSpec, server: str, base_url: str, model: str, streams: int,
               raw: Path, rep: int = 0) -> Level:  # fmt: skip
    """Run guidellm for repetition `rep` of one level against `base_url`; its scenario, log
    and JSON go to `raw` as `<server>-streams<N>[-rep<R>].*`. A guidellm that fails or stalls
    is run once more; failing twice is a `failure`, not an exception."""
    stem = raw / f"{server}-streams{streams}{_rep_suffix(rep)}"
    stem.with_suffix(".scenario.json").write_text(
        json.dumps(scenario(load, base_url, model, streams, rep), indent=1)
    )
    out = stem.with_suffix(".guidellm.json")
    argv = [str(load.guidellm), "run", "-c", str(stem.with_suffix(".scenario.json")),
            "--tokenizer", f"kind=huggingface_auto,model={load.tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]  # fmt: skip
    for attempt in (1, 2):
        out.unlink(missing_ok=True)
        log = stem.with_suffix(f".{attempt}.log")
        rc = _run_logged(argv, log, f"{server} streams={streams}", load.seconds + 300)
        if rc == 0 and out.is_file():
            return dataclasses.replace(parse_guidellm(out, server, streams), repetition=rep)
        print(f"   [{server} streams={streams}] guidellm failed (status {rc}, {log})", flush=True)
    return Level(server, "http", streams, 0.0, 0.0, None, None, None, None, 0, 0, 0,
                 failure=f"guidellm failed twice (status {rc}; log: {log})",
                 repetition=rep)  # fmt: skip


def _rep_suffix(rep: int) -> str:
    return f"-rep{rep}" if rep else ""


# NOTE: guidellm logs progress on every scheduler update (at most every few seconds while
# requests run); on a busy machine one run in a few dozen stalls at a level's start, silent.
STALL_S = 120.0


def _run_logged(argv: list[str], log: Path, label: str, timeout_s: float) -> int:
    """Run `argv` to completion, every line to `log`, guidellm's progress lines echoed as
    `   [label] ...`. The whole process group is killed (status -9) after `timeout_s`, or
    after STALL_S seconds without a line of output."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True,
        )  # fmt: skip
        last = [time.monotonic()]
        done = threading.Event()
        watchdog = threading.Thread(target=_watch, args=(proc, last, done, timeout_s))
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                last[0] = time.monotonic()
                sink.write(line)
                if "progress:_log_update" in line or "Starting benchmark" in line:
                    print(f"   [{label}] {line.rsplit(' - ', 1)[-1].strip()}", flush=True)
            return proc.wait()
        finally:
            done.set()
            watchdog.join()
            if proc.poll() is None:  # NOTE: interrupted (Ctrl-C): its own session hears none
                _kill_group(proc)
                proc.wait()


def _watch(proc: subprocess.Popen, last: list[float], done: threading.Event,
           timeout_s: float) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not done.wait(1.0):
        now = time.monotonic()
        if now > deadline or now - last[0] > STALL_S:
            _kill_group(proc)
            return


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to `proc`'s process group: guidellm and its worker processes."""
    with contextlib.suppress(ProcessLookupError):  # NOTE: it may have just exited
        os.killpg(proc.pid, signal.SIGKILL)


def parse_guidellm(path: Path, server: str, streams: int) -> Level:
    """The `Level` of guidellm 0.8.1's JSON report holding one benchmark. `seconds` is its
    measurement window (after the warmup); output tok/s is guidellm's rate of output tokens
    inside that window from all requests, finished or not (`output_tokens_per_second.total`);
    latencies are of finished requests. Counts are `metrics.request_totals` (the request
    lists may be sampled)."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    metrics, totals = bench["metrics"], bench["metrics"]["request_totals"]

    def pct(name: str, q: str) -> float | None:
        ok = metrics[name]["successful"]
        return ok["percentiles"][q] if ok.get("count") else None

    def mean(name: str) -> float | None:
        ok = metrics[name]["successful"]
        return ok["mean"] if ok.get("count") else None

    errors = {str((r.get("info") or {}).get("error") or "")[:300]
              for r in bench["requests"].get("errored") or []}  # fmt: skip
    return Level(
        server, "http", streams, float(bench["duration"]),
        float(metrics["output_tokens_per_second"]["total"]["mean"] or 0.0),
        pct("inter_token_latency_ms", "p50"), pct("inter_token_latency_ms", "p99"),
        pct("time_to_first_token_ms", "p50"), pct("time_to_first_token_ms", "p99"),
        int(totals["successful"]), int(totals["errored"]), int(totals["incomplete"]),
        tuple(sorted(errors - {""})[:5]), prompt_tokens_mean=mean("prompt_token_count"),
        output_tokens_mean=mean("output_token_count"),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class LoopRequest:
    """One request of our own closed loops (gRPC or the HTTP loop): `sent_s` and `ended_s` from
    the level's start, the other times in seconds from its send."""

    prompt_len: int
    sent_s: float
    ended_s: float
    ttft_s: float | None
    itl_s: float | None  # (last - first token) / (tokens - 1)
    tokens: int
    window_tokens: int  # tokens that arrived after the level's warmup
    status: str  # "ok", "incomplete" or the gRPC status name and details


# One request of a closed loop: (prompt, start, window, salt) -> its record
SendOne = Callable[[list[int], float, tuple[float, float], str], LoopRequest]


def grpc_level(load: LoadSpec, address: str, vocab: int, streams: int, raw: Path,
               rep: int = 0) -> Level:  # fmt: skip
    """The same load as guidellm's (same prompt lengths, as random token ids below `vocab`)
    straight to our router, `streams` closed loops for `load.seconds`; every request's record
    goes to `raw`/pagedserve-grpc-streams<N>[-rep<R>].json."""
    client = Client(address)
    params = SamplingParams(temperature=0.0, max_tokens=load.output_tokens, ignore_eos=True)
    try:
        return _closed_loops(load, vocab, streams, rep, "grpc", raw,
                             partial(_one, client, params=params))  # fmt: skip
    finally:
        client.close()


def http_loop_level(load: LoadSpec, base_url: str, model: str, vocab: int, streams: int,
                    raw: Path, rep: int = 0) -> Level:  # fmt: skip
    """The gRPC loop's load through our gateway's `/v1/completions` instead (the same token
    ids as the prompt, no chat template, streamed), by a client as light as the gRPC one
    (`http.client`, a thread per stream): with the gRPC level beside it, the gateway's share of
    the rate without a heavy load generator's CPU in it. API "http-loop"; records in
    `raw`/pagedserve-http-loop-streams<N>[-rep<R>].json."""
    send = partial(_http_one, urllib.parse.urlsplit(base_url), model, load.output_tokens)
    return _closed_loops(load, vocab, streams, rep, "http-loop", raw, send)


def _closed_loops(load: LoadSpec, vocab: int, streams: int, rep: int, api: str, raw: Path,
                  send: SendOne) -> Level:  # fmt: skip
    records: list[LoopRequest] = []
    start = time.perf_counter()
    salt = f"s15-{api}-{streams}-{rep}"  # NOTE: no prefix-cache hits across levels
    seeds = [1_000_000 * rep + 1_000 * streams + k for k in range(streams)]
    loops = [threading.Thread(target=_loop, args=(send, load, vocab, start, seed, salt, records))
             for seed in seeds]  # fmt: skip
    for t in loops:
        t.start()
    for t in loops:
        t.join()
    path = raw / f"pagedserve-{api}-streams{streams}{_rep_suffix(rep)}.json"
    path.write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    level = loop_summary(records, streams, load.seconds, load.warmup_s)
    return dataclasses.replace(level, api=api, repetition=rep)


def _loop(send: SendOne, load: LoadSpec, vocab: int, start: float, seed: int, salt: str,
          records: list[LoopRequest]) -> None:  # fmt: skip
    """One stream: one request after another until the level's end, prompts from `seed`."""
    rng = random.Random(seed)
    low, high = load.prompt_range
    window = (start + load.warmup_s, start + load.seconds)
    while time.perf_counter() < window[1]:
        n = min(high, max(low, round(rng.gauss(load.prompt_tokens, load.prompt_stdev))))
        prompt = [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]
        records.append(send(prompt, start, window, salt))  # NOTE: list.append is atomic


def _one(client: Client, prompt: list[int], start: float, window: tuple[float, float], salt: str,
         *, params: SamplingParams) -> LoopRequest:  # fmt: skip
    """One request, cancelled by its deadline at the window's end."""
    sent = time.perf_counter()
    times: list[float] = []
    tokens = in_window = 0
    status = "ok"
    try:
        stream = client.generate(prompt, params, timeout=window[1] - sent, cache_salt=salt)
        for msg in stream:
            if msg.token_ids:
                now = time.perf_counter()
                times.append(now - sent)
                tokens += len(msg.token_ids)
                in_window += len(msg.token_ids) if now >= window[0] else 0
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        status = "incomplete" if code is grpc.StatusCode.DEADLINE_EXCEEDED else (
            f"{code.name}: {err.details()}"[:300])  # type: ignore[attr-defined]  # fmt: skip
    ended = time.perf_counter()
    itl = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
    return LoopRequest(len(prompt), sent - start, ended - start, times[0] if times else None,
                       itl, tokens, in_window, status)  # fmt: skip


def _http_one(url: urllib.parse.SplitResult, model: str, max_tokens: int, prompt: list[int],
              start: float, window: tuple[float, float], salt: str) -> LoopRequest:  # fmt: skip
    """One streamed `/v1/completions` request, dropped (incomplete) at the window's end. Its
    tokens: the final usage chunk's count; in the window: that count's share of the chunks
    that arrived there (a chunk may hold more than one token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    tokens = in_window = 0
    status = "ok"
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port,
                                      timeout=max(0.1, window[1] - sent))  # fmt: skip
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            status = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
        for line in resp if resp.status == 200 else ():
            now = time.perf_counter()
            if now >= window[1]:
                status = "incomplete"
                break
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                if chunk.get("choices"):
                    times.append(now - sent)
                    in_window += now >= window[0]
    except (OSError, http.client.HTTPException) as err:  # NOTE: a socket timeout is an OSError
        late = time.perf_counter() >= window[1] - 0.05
        status = "incomplete" if late else f"{type(err).__name__}: {err}"[:300]
    finally:
        conn.close()
    if times and tokens:
        in_window = round(in_window * tokens / len(times))
    else:
        tokens = len(times)
    ended = time.perf_counter()
    itl = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None
    return LoopRequest(len(prompt), sent - start, ended - start, times[0] if times else None,
                       itl, tokens, in_window, status)  # fmt: skip


def loop_summary(records: list[LoopRequest], streams: int, seconds: float,
                 warmup_s: float) -> Level:  # fmt: skip
    """The `Level` of one of our closed loops (api "grpc"; the caller renames it): output
    tok/s is every token that arrived after the warmup, over the window (`seconds` -
    `warmup_s`); latencies of finished requests that ended after the warmup; errors from the
    whole level."""
    window = seconds - warmup_s
    done = [r for r in records if r.ended_s >= warmup_s]
    ok = [r for r in done if r.status == "ok"]
    bad = [r for r in records if r.status not in ("ok", "incomplete")]
    itl = [1e3 * r.itl_s for r in ok if r.itl_s is not None]
    ttft = [1e3 * r.ttft_s for r in ok if r.ttft_s is not None]
    return Level(
        "pagedserve", "grpc", streams, window, sum(r.window_tokens for r in records) / window,
        quantile(itl, 0.5), quantile(itl, 0.99), quantile(ttft, 0.5), quantile(ttft, 0.99),
        len(ok), len(bad), sum(r.status == "incomplete" for r in done),
        tuple(sorted({r.status for r in bad})[:5]),
        prompt_tokens_mean=statistics.fmean(r.prompt_len for r in ok) if ok else None,
        output_tokens_mean=statistics.fmean(r.tokens for r in ok) if ok else None,
    )  # fmt: skip


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile, linear between order statistics; None for no values."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]
