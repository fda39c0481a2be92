"""The price of the router's hop: TTFT and tokens/s through the router vs calling the workers
directly (Prefill, then Decode with the handle: what the router does, minus routing, validation,
detokenization and the extra network hop).

    python -m pagedserve.bench.router_hop [--requests 16] [--reps 3] [--max-tokens 32]

One cluster (`pagedserve up` code: Redis, router, 1 prefill, 1 decode worker); requests run one
at a time so latency, not queueing, is measured; the two paths alternate within each
repetition. Prints a Markdown table (median, min–max over repetitions).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from pagedserve.client import Client
from pagedserve.internal.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
)
from pagedserve.launcher import start_cluster
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.tiny_model import make_tiny_model


def via_router(client: Client, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    for part in client.generate(prompt, params, timeout=120):
        if not tokens and part.token_ids:
            ttft = time.perf_counter() - start
        tokens += len(part.token_ids)
    return ttft, tokens


def direct(prefill, decode, prompt: list[int], params: SamplingParams, n: int) -> tuple[float, int]:
    request = worker_pb2.WorkerRequest(
        request_id=f"direct-{n}", prompt_token_ids=prompt, sampling=sampling_to_proto(params)
    )
    start = time.perf_counter()
    first = prefill.Prefill(prefill_pb2.PrefillRequest(request=request), timeout=120)
    ttft = time.perf_counter() - start
    tokens = 1
    call = decode_pb2.DecodeRequest(
        request=request, first_token=first.first_token, kv_handle=first.kv_handle
    )
    for part in decode.Decode(call, timeout=120):
        tokens += len(part.token_ids)
    return ttft, tokens


def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="pagedserve-hop-"))
    model = make_tiny_model(work / "model", layers=args.layers, hidden=args.hidden, heads=4)
    up = argparse.Namespace(
        model=str(model), host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None,
        block_size=16, dtype=None, kv_cache_memory="64MiB", start_timeout=120.0,
        otlp_traces_endpoint=None, metrics=False,
    )  # fmt: skip
    (work / "logs").mkdir()
    cluster = start_cluster(up, work / "logs")
    try:
        workers = {c.name: c.address for c in cluster.children}
        prefill = prefill_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(workers["prefill-0"]))
        decode = decode_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(workers["decode-0"]))
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = [[5 + (i * 7 + j) % 400 for j in range(64)] for i in range(args.requests)]
        results: dict[str, list[tuple[float, float]]] = {"router": [], "direct": []}
        with Client(cluster.router_address) as client:
            via_router(client, prompts[0], params)  # warm-up both paths
            direct(prefill, decode, prompts[0], params, -1)
            for rep in range(args.reps):
                for path in ("router", "direct") if rep % 2 == 0 else ("direct", "router"):
                    ttfts, tokens, start = [], 0, time.perf_counter()
                    for i, prompt in enumerate(prompts):
                        if path == "router":
                            ttft, n = via_router(client, prompt, params)
                        else:
                            ttft, n = direct(prefill, decode, prompt, params, rep * 10_000 + i)
                        ttfts.append(ttft)
                        tokens += n
                    elapsed = time.perf_counter() - start
                    results[path].append((statistics.median(ttfts), tokens / elapsed))
    finally:
        cluster.stop()
    return _table(results, args)


def _table(results: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> str:
    def summary(values: list[float], scale: float = 1.0) -> str:
        v = [x * scale for x in values]
        return f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})"

    ratio_ttft = [r[0] / d[0] for r, d in zip(results["router"], results["direct"], strict=True)]
    ratio_tps = [r[1] / d[1] for r, d in zip(results["router"], results["direct"], strict=True)]
    lines = [
        f"{args.requests} sequential requests x {args.reps} reps, 64-token prompts, "
        f"{args.max_tokens} new tokens, tiny Llama ({args.layers} layers, hidden {args.hidden})",
        "",
        "| path | median TTFT ms | tokens/s |",
        "|---|---|---|",
        f"| router | {summary([r[0] for r in results['router']], 1000)} | "
        f"{summary([r[1] for r in results['router']])} |",
        f"| direct to workers | {summary([d[0] for d in results['direct']], 1000)} | "
        f"{summary([d[1] for d in results['direct']])} |",
        f"| router ÷ direct | {summary(ratio_ttft)} | {summary(ratio_tps)} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve bench router-hop")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    print(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
