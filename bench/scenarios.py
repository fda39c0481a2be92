"""Scenarios S1-S9 (docs/benchmarks/method.md); each runs the S10 gate on a sample of its requests.

Each takes the shared `Context` and returns a `ScenarioResult` (ratios per interleaved
repetition, the gate, raw per-request data). Peers that cannot run here are skipped with a note.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial

from pagedserve.bench import gate
from pagedserve.bench.driver import PEERS_PYTHON, Context, PeerError, PeerProcess, Ratio
from pagedserve.bench.driver import ScenarioResult as Result
from pagedserve.bench.workloads import BenchRequest, make_workload, with_arrivals

BLOCK = 16
# NOTE: S1 is offline throughput: vLLM-CPU's peer is `LLM.generate` (whole outputs) and the
# engine's is in process, so the cluster's client asks, as an offline client would, for its first
# token at once and the rest in one message (the proto's largest stream_interval); the
# per-token stream is measured beside it as `cluster-streamed` (stream_interval 1)
OFFLINE_STREAM_INTERVAL = 1 << 16


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _slim(out: dict) -> dict:
    return {k: v for k, v in out.items() if k not in ("tokens", "steps")}


def _gate(ctx: Context, res: Result, requests: list[BenchRequest], tokens: dict, model=None):
    verdict = gate.check(model or ctx.model, requests, tokens)
    if res.gate and not res.gate["passed"]:
        return
    res.gate = verdict


def _interleave(
    ctx: Context,
    res: Result,
    peers: Mapping[str, Callable[[int], dict]],
    optional: frozenset[str] = frozenset(),
) -> dict[str, list[dict]]:
    """Run every peer once per repetition, rotating the order; raw data into `res.runs`."""
    outs: dict[str, list[dict]] = {name: [] for name in peers}
    names = list(peers)
    for rep in range(ctx.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if name in optional and len(outs[name]) < rep:
                continue  # NOTE: it failed before; its later repetitions are skipped too
            started = time.perf_counter()
            try:
                outs[name].append(peers[name](rep))
                _progress(ctx, rep, name, outs[name][-1], time.perf_counter() - started)
            except PeerError as e:
                if name not in optional:
                    raise
                res.notes.append(f"{name} failed at repetition {rep}: {str(e)[:300]}")
    for name in optional:
        if len(outs[name]) < ctx.reps:
            del outs[name]
    for name, runs in outs.items():
        res.runs[name] = [_slim(o) for o in runs]
    return outs


def _progress(ctx: Context, rep: int, name: str, out: dict, seconds: float) -> None:
    """One line per run, so a long benchmark shows where it is."""
    failed = f", {out['num_errors']} failed" if out.get("num_errors") else ""
    tok_s = out.get("useful_tok_s", 0.0)
    print(f"   rep {rep + 1}/{ctx.reps} {name}: {tok_s:.1f} tok/s{failed} ({seconds:.0f}s)",
          flush=True)  # fmt: skip


def _usable(res: Result, outs: dict, name: str) -> bool:
    """A peer whose runs had failed requests, or whose tokens failed the gate, gets no ratio
    (a note says why): its tok/s measure something else than the workload."""
    errors = [o.get("num_errors", 0) for o in outs[name]]
    if any(errors):
        res.notes.append(f"{name}: no ratio: failed requests per repetition {errors}")
        if name in ("cluster", "cluster-streamed"):
            res.gate = {**res.gate, "passed": False, "cluster_errors": errors}
        return False
    verdict = res.runs.get(f"{name}-gate")
    if verdict is not None and not verdict["passed"]:
        res.notes.append(f"{name}: no ratio: its tokens failed the gate {verdict['mismatches']}")
        return False
    return True


def _ratio(outs: dict, a: str, b: str, key: Callable[[dict], float]) -> list[float]:
    return [key(x) / max(key(y), 1e-12) for x, y in zip(outs[a], outs[b], strict=True)]


def _run_rep(peer: PeerProcess, sets: list[list[BenchRequest]], rep: int, **options) -> dict:
    return peer.run(sets[rep], **options)


def _tok_s(o: dict) -> float:
    return o["useful_tok_s"]


def _ttft_median(o: dict) -> float:
    return o["ttft"]["median"]


def _start_optional(ctx: Context, res: Result, name: str, argv: list[str]) -> PeerProcess | None:
    try:
        peer = PeerProcess(name, argv, ctx.work)
        peer.run(make_workload("random", 2, ctx.vocab, 999))
        return peer
    except PeerError as e:
        res.notes.append(f"{name} skipped: {str(e).splitlines()[0][:300]}")
        return None


# -- S1 -----------------------------------------------------------------------------------------


def throughput(ctx: Context) -> Result:
    res = Result("S1 throughput")
    n = ctx.n(16, 48)
    sets = [make_workload("random", n, ctx.vocab, 100 + rep) for rep in range(ctx.reps)]
    sizes = ["8", "16"] if ctx.quick else ["8", "32", "64"]
    argv = ["-m", "pagedserve.bench.peers"]
    import sys

    peers: dict[str, PeerProcess | None] = {
        "engine": ctx.engine(),
        "cluster": ctx.cluster(),
        # NOTE: the same cluster fully disaggregated (every prompt on the prefill worker, as
        # across hosts), against `pagedserve up`'s default that computes short prompts on the
        # decode worker (docs/architecture.md, "Conditional disaggregation")
        "cluster-remote": _start_optional(
            ctx, res, "cluster-remote",
            [sys.executable, *argv, "cluster", "--model", ctx.model,
             "--max-local-prefill-tokens", "0", *ctx.dtype_flags()],
        ),
        "hf-static": _start_optional(
            ctx, res, "hf-static",
            [sys.executable, *argv, "hf-static", "--model", ctx.model, "--batch-sizes", *sizes,
             *ctx.dtype_flags()],
        ),
        "hf-cb": _start_optional(
            ctx, res, "hf-cb",
            [sys.executable, *argv, "hf-cb", "--model", ctx.model, *ctx.dtype_flags()],
        ),
    }  # fmt: skip
    if not ctx.vllm:
        res.notes.append("vllm-cpu not run (--quick: its start-up takes minutes; use --vllm)")
    elif PEERS_PYTHON.exists():
        script = str(PEERS_PYTHON.parent.parent.parent.parent / "bench" / "peer_vllm.py")
        peers["vllm-cpu"] = _start_optional(
            ctx, res, "vllm-cpu",
            [str(PEERS_PYTHON), "-P", script, "--model", ctx.model, *ctx.dtype_flags()],
        )  # fmt: skip
    else:
        res.notes.append("vllm-cpu skipped: no peers venv (run `make peers`)")
    live = {k: p for k, p in peers.items() if p is not None}
    ctx.engine().run(sets[0][:4])
    runners = {k: partial(_run_rep, p, sets) for k, p in live.items()}
    for name in ("cluster", "cluster-remote"):
        if name in live:
            runners[name] = partial(
                _run_rep, live[name], sets, stream_interval=OFFLINE_STREAM_INTERVAL
            )
    # NOTE: the same prompts as `cluster`'s run on the same cluster: salted, so that they do not
    # find their prefixes cached by it (they did: 1.36x the engine on SmolLM2)
    runners["cluster-streamed"] = partial(
        _run_rep, live["cluster"], sets, stream_interval=1, cache_salt="cluster-streamed"
    )
    outs = _interleave(ctx, res, runners, frozenset(live) - {"engine", "cluster"})
    for name in ("engine", "cluster", "cluster-streamed"):
        _gate(ctx, res, sets[0], outs[name][0]["tokens"])
    for name in ("cluster-remote", "hf-static", "hf-cb", "vllm-cpu"):
        if name in outs:
            res.runs[f"{name}-gate"] = gate.check(ctx.model, sets[0], outs[name][0]["tokens"])
        if name in live:
            live[name].close()
    _s1_ratios(res, outs, tiny=not ctx.user_model)
    ctx.capacity_req_s = statistics.median(o["req_s"] for o in outs["engine"])
    return res


def _s1_ratios(res: Result, outs: dict[str, list[dict]], *, tiny: bool = True) -> None:
    """The S1 ratios of peers that ran clean. Engine / vLLM-CPU: >= 1.0 on the tiny model,
    >= 1.3 on a real one (`--model`), as issue 15 asks."""
    usable = {name: _usable(res, outs, name) for name in outs}
    vllm_goal = (">= 1.0", 1.0) if tiny else (">= 1.3", 1.3)
    for peer, goal, target in (
        ("hf-static", ">= 3", 3.0), ("hf-cb", "", None), ("vllm-cpu", *vllm_goal)
    ):  # fmt: skip
        if usable.get(peer):
            res.ratios.append(
                Ratio("S1", f"useful tok/s: engine / {peer}", _ratio(outs, "engine", peer, _tok_s),
                      goal, target)
            )  # fmt: skip
    if usable.get("vllm-cpu") and usable["cluster"]:
        res.ratios.append(
            Ratio("S1", "useful tok/s: cluster / vllm-cpu",
                  _ratio(outs, "cluster", "vllm-cpu", _tok_s), ">= 1.0", 1.0)
        )  # fmt: skip
    if usable["cluster"]:
        res.ratios.append(
            Ratio("S1", "useful tok/s: cluster / engine",
                  _ratio(outs, "cluster", "engine", _tok_s), ">= 0.9", 0.9)
        )  # fmt: skip
    if usable.get("cluster-streamed"):
        res.ratios.append(
            Ratio("S1", "useful tok/s: cluster-streamed / engine",
                  _ratio(outs, "cluster-streamed", "engine", _tok_s), "", None)
        )  # fmt: skip
    if usable["cluster"] and usable.get("cluster-remote"):
        res.ratios += [
            Ratio("S1", "useful tok/s: cluster / cluster-remote",
                  _ratio(outs, "cluster", "cluster-remote", _tok_s), "", None),
            Ratio("S1", "median TTFT: cluster / cluster-remote",
                  _ratio(outs, "cluster", "cluster-remote", _ttft_median), "", None),
        ]  # fmt: skip


# -- S2 -----------------------------------------------------------------------------------------


def serve(ctx: Context, rates: list[float] | None = None) -> Result:
    res = Result("S2 serve")
    n = ctx.n(12, 48)
    capacity = ctx.capacity(n)
    rates = rates or [f * capacity for f in (0.25, 0.5, 0.9)]
    res.notes.append(
        f"capacity {capacity:.2f} req/s (engine, offline); rates {[round(r, 2) for r in rates]}; "
        "peers online: pagedserve cluster vs in-process engine (HF CB / vLLM online not run)"
    )
    curves: dict[str, list] = {"cluster": [], "engine": []}
    for rate in rates:
        sets = [
            with_arrivals(make_workload("random", n, ctx.vocab, 200 + rep), rate, rep)
            for rep in range(ctx.reps)
        ]
        sub = Result("tmp")
        outs = _interleave(ctx, sub, {
            "cluster": partial(_run_rep, ctx.cluster(), sets),
            "engine": partial(_run_rep, ctx.engine(), sets),
        })  # fmt: skip
        res.runs[f"rate={rate:.3f}"] = sub.runs
        for name in curves:
            curves[name].append({
                "rate": rate,
                "goodput": statistics.median(o["goodput_req_s"] for o in outs[name]),
                "p99_tpot": statistics.median(o["tpot"]["p99"] or 0 for o in outs[name]),
                "p99_ttft": statistics.median(o["ttft"]["p99"] or 0 for o in outs[name]),
                "client": outs[name][0].get("client"),
            })  # fmt: skip
        res.ratios.append(Ratio(
            "S2", f"goodput cluster / engine @ {rate:.2f} req/s",
            _ratio(outs, "cluster", "engine", lambda o: o["goodput_req_s"] + 1e-9),
        ))  # fmt: skip
        res.ratios.append(Ratio(
            "S2", f"p99 TPOT cluster / engine @ {rate:.2f} req/s",
            _ratio(outs, "cluster", "engine", lambda o: o["tpot"]["p99"] or 0.0),
            higher_is_better=False,
        ))  # fmt: skip
        _gate(ctx, res, sets[0], outs["cluster"][0]["tokens"])
    res.runs["curves"] = curves
    return res


# -- S3 -----------------------------------------------------------------------------------------


def kv_efficiency(ctx: Context) -> Result:
    """Paged vs reserve-to-max KV on the same engine code (`DecodeEngineConfig.kv_policy`), the
    same request sets and the same block budget."""
    res = Result("S3 kv-efficiency")
    n = ctx.n(24, 64)
    sets = [make_workload("random", n, ctx.vocab, 300 + rep) for rep in range(ctx.reps)]
    demand = sum(_blocks(len(r.prompt) + r.output_len) for r in sets[0])
    blocks = max(demand * 2 // 5, 32)
    engine = {"num_blocks": blocks, "prefix_caching": False, "max_num_seqs": n}
    res.notes.append(
        f"KV budget {blocks} blocks x {BLOCK} = 40% of the first set's demand ({demand} blocks); "
        "reserve-max = the same engine with `--kv-policy reserve-max` (prompt + max_tokens "
        "slots held from admission), same requests and budget"
    )
    outs = _interleave(ctx, res, {
        "paged": lambda rep: ctx.engine().run(sets[rep], engine=engine),
        "reserve-max": lambda rep: ctx.engine().run(
            sets[rep], engine={**engine, "kv_policy": "reserve-max"}
        ),
    })  # fmt: skip
    kv = {name: [o["kv"] for o in runs] for name, runs in outs.items()}
    res.ratios += [
        Ratio("S3", "KV util (time-weighted used/allocated), paged", [k["time_weighted_util"]
              for k in kv["paged"]], ">= 0.95", 0.95),
        Ratio("S3", "KV util (time-weighted used/allocated), reserve-max", [k["time_weighted_util"]
              for k in kv["reserve-max"]]),
        Ratio("S3", "max concurrent seqs: paged / reserve-max", [
            p["max_running"] / r["max_running"]
            for p, r in zip(kv["paged"], kv["reserve-max"], strict=True)
        ]),
        Ratio("S3", "useful tok/s: paged / reserve-max",
              _ratio(outs, "paged", "reserve-max", _tok_s)),
    ]  # fmt: skip
    _gate(ctx, res, sets[0], outs["paged"][0]["tokens"])
    _gate(ctx, res, sets[0], outs["reserve-max"][0]["tokens"])
    return res


# -- S4 / S5 ------------------------------------------------------------------------------------


def prefix(ctx: Context) -> Result:
    res = Result("S4 prefix")
    n = ctx.n(16, 48)
    sets = [make_workload("prefix-repetition", n, ctx.vocab, 400 + rep) for rep in range(ctx.reps)]
    outs = _interleave(ctx, res, {
        "on": lambda rep: ctx.engine().run(sets[rep], engine={"prefix_caching": True}),
        "off": lambda rep: ctx.engine().run(sets[rep], engine={"prefix_caching": False}),
    })  # fmt: skip
    ideal = [_ideal_cached(s) for s in sets]

    def computed(o: dict) -> float:
        return o["prefix"]["prompt_tokens"] - o["prefix"]["cached_prompt_tokens"]

    res.ratios += [
        Ratio("S4", "mean TTFT: cache on / off", _ratio(outs, "on", "off",
              lambda o: o["ttft"]["mean"]), higher_is_better=False),
        Ratio("S4", "computed prompt tokens: on / off", _ratio(outs, "on", "off", computed),
              higher_is_better=False),
        Ratio("S4", "prefix hit tokens: measured / ideal", [
            o["prefix"]["cached_prompt_tokens"] / max(i, 1) for o, i in zip(outs["on"], ideal,
            strict=True)], ">= 0.9", 0.9),
    ]  # fmt: skip
    res.notes.append("all requests at t = 0: requests batched into the same first steps cannot "
                     "hit each other's blocks (they are not cached until computed)")  # fmt: skip
    _gate(ctx, res, sets[0], outs["on"][0]["tokens"])
    _eviction(ctx, res)
    return res


SKEWED_KV_BLOCKS = 192  # the running prompts (4 x <= 36 blocks) + a cache smaller than the demand
SKEWED_MAX_SEQS = 4


def _eviction(ctx: Context, res: Result) -> None:
    """S4's second half: the `hits` eviction policy against LRU where the KV budget forces
    eviction: a few Zipf-popular system prompts among many one-off prompts."""
    n = ctx.n(96, 192)
    sets = [make_workload("skewed-prefix", n, ctx.vocab, 600 + rep) for rep in range(ctx.reps)]
    budget = {"num_blocks": SKEWED_KV_BLOCKS, "max_num_seqs": SKEWED_MAX_SEQS}

    def run(rep: int, policy: str) -> dict:
        return ctx.engine().run(sets[rep], engine={**budget, "eviction_policy": policy})

    outs = _interleave(ctx, res, {
        "skewed-lru": lambda rep: run(rep, "lru"),
        "skewed-hits": lambda rep: run(rep, "hits"),
    })  # fmt: skip
    ideal = [_ideal_cached(s) for s in sets]

    def hit(o: dict) -> float:
        return o["prefix"]["cached_prompt_tokens"]

    res.ratios += [
        Ratio("S4", "prefix hit tokens (skewed, evicting): hits / lru",
              _ratio(outs, "skewed-hits", "skewed-lru", hit), ">= 1.0", 1.0),
        Ratio("S4", "prefix hit tokens (skewed, evicting): hits / ideal",
              [hit(o) / max(i, 1) for o, i in zip(outs["skewed-hits"], ideal, strict=True)]),
        Ratio("S4", "prefix hit tokens (skewed, evicting): lru / ideal",
              [hit(o) / max(i, 1) for o, i in zip(outs["skewed-lru"], ideal, strict=True)]),
    ]  # fmt: skip
    demand = sum(_blocks(len(r.prompt)) for r in sets[0])
    res.notes.append(
        f"skewed: {n} requests, half of them one of 6 system prompts of 256 tokens (Zipf 1/k) + "
        f"16-64 tokens, half one-off prompts of 128-512 tokens, 8 output tokens; KV budget "
        f"{SKEWED_KV_BLOCKS} blocks x {BLOCK} (the first set's prompts need {demand}), at most "
        f"{SKEWED_MAX_SEQS} running; ideal = an unbounded cache"
    )
    _gate(ctx, res, sets[0], outs["skewed-hits"][0]["tokens"])


def _ideal_cached(requests: list[BenchRequest]) -> int:
    """Full blocks every request could reuse from an earlier one (longest shared prefix)."""
    seen: list[list[int]] = []
    total = 0
    for r in requests:
        best = 0
        for p in seen:
            k = next((i for i, (a, b) in enumerate(zip(p, r.prompt, strict=False)) if a != b),
                     min(len(p), len(r.prompt)))  # fmt: skip
            best = max(best, k)
        total += min(best, len(r.prompt) - 1) // BLOCK * BLOCK
        seen.append(r.prompt)
    return total


def shared_prefix_memory(ctx: Context) -> Result:
    res = Result("S5 shared-prefix-memory")
    sets = [_ten_sharing(ctx, 500 + rep) for rep in range(ctx.reps)]
    outs = _interleave(ctx, res, {
        "sharing": lambda rep: ctx.engine().run(
            sets[rep], warm_first=True, engine={"prefix_caching": True}),
        "no-sharing": lambda rep: ctx.engine().run(
            sets[rep], warm_first=True, engine={"prefix_caching": False}),
    })  # fmt: skip
    shared = 500 // BLOCK
    private = [sum(_blocks(len(r.prompt) + r.output_len) - shared for r in s) for s in sets]
    res.ratios += [
        Ratio("S5", "peak KV blocks: sharing / no sharing",
              _ratio(outs, "sharing", "no-sharing", lambda o: o["kv"]["peak_blocks"]),
              higher_is_better=False),
        Ratio("S5", "copies of the 500-token prefix held (sharing)", [
            (o["kv"]["peak_blocks"] - p) / shared for o, p in zip(outs["sharing"], private,
            strict=True)], "<= 1.0 (+ rounding)", 1.05, higher_is_better=False),
    ]  # fmt: skip
    res.notes.append("10 requests x (500-token shared prefix + 16-token suffix), 16 output tokens; "
                     "the first request is prefilled before the other nine arrive")  # fmt: skip
    _gate(ctx, res, sets[0], outs["sharing"][0]["tokens"])
    return res


def _ten_sharing(ctx: Context, seed: int) -> list[BenchRequest]:
    base = make_workload("random", 11, ctx.vocab, seed)
    prefix = (base[0].prompt * 4)[:500]
    return [
        BenchRequest(f"x{seed}-{i}", prefix + r.prompt[:16], 16) for i, r in enumerate(base[1:])
    ]
