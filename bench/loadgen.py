"""Load generator against the public API: `pagedserve.v1.Generation/Generate`, streamed.

    python -m pagedserve.bench.loadgen --router HOST:PORT [--workload random] [-n 32]
        [--rate inf|R] [--burstiness 1] [--max-concurrency N] [--seed 0]

One thread per in-flight request (grpc's sync API): a dispatcher sleeps until each request's
arrival (gamma gaps, `workloads.with_arrivals`) and hands it to a pool whose size is the
concurrency cap. Every request asks for exactly `output_len` tokens with `ignore_eos`.

The client measures its own overhead: its process CPU time over the run (a fraction of one core)
and the dispatch lag (sent - due). A client that keeps up has a lag far below the TTFT.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagedserve.bench.metrics import SLO, RequestResult, percentiles, summarize
from pagedserve.bench.workloads import BenchRequest, make_workload, with_arrivals
from pagedserve.client import Client
from pagedserve.sampling_params import SamplingParams


def _one(
    client: Client,
    req: BenchRequest,
    t0: float,
    timeout_s: float,
    stream_interval: int = 0,
    cache_salt: str = "",
) -> RequestResult:
    result = RequestResult(req.request_id, len(req.prompt), req.output_len, req.priority)
    result.arrival = req.arrival
    params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
    result.sent = time.perf_counter() - t0
    try:
        stream = client.generate(
            req.prompt,
            params,
            request_id=req.request_id,
            priority=req.priority,
            timeout=timeout_s,
            stream_interval=stream_interval,
            cache_salt=cache_salt,
        )
        for msg in stream:
            if msg.token_ids:
                result.token_times.append(time.perf_counter() - t0)
                result.tokens.extend(msg.token_ids)
    except grpc.RpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


def run_load(
    address: str,
    requests: list[BenchRequest],
    *,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    slo: SLO | None = None,
    stream_interval: int = 0,
    cache_salt: str = "",
) -> dict:
    """Send `requests` at their arrival times; return the summary, client overhead and the raw
    per-request results (`requests` key, JSON-ready, plus `tokens` for the correctness gate).
    `cache_salt`: every request's (a run of prompts the cluster has seen, without their
    cached prefixes)."""
    workers = max_concurrency or len(requests)
    client = Client(address)
    results: list[RequestResult] = []
    lock = threading.Lock()
    cpu0, t0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = []
        for req in sorted(requests, key=lambda r: r.arrival):
            delay = req.arrival - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            futures.append(
                pool.submit(_one, client, req, t0, timeout_s, stream_interval, cache_salt)
            )
        for f in futures:
            r = f.result()
            with lock:
                results.append(r)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    client.close()
    end = max((r.token_times[-1] for r in results if r.token_times), default=wall)
    start = min((r.sent for r in results), default=0.0)
    summary = summarize(results, end - start, slo or SLO())
    summary["client"] = {
        "cpu_s": cpu,
        "wall_s": wall,
        "cpu_fraction_of_one_core": cpu / max(wall, 1e-9),
        "dispatch_lag_s": percentiles([r.sent - r.arrival for r in results]),
    }
    summary["requests"] = [r.to_json() for r in results]
    summary["tokens"] = {r.request_id: r.tokens for r in results}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench loadgen", description=__doc__)
    p.add_argument("--router", required=True, help="host:port of the router")
    p.add_argument("--workload", default="random")
    p.add_argument("-n", "--num-requests", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512, help="prompt ids are drawn below this")
    p.add_argument("--rate", type=float, default=float("inf"), help="req/s (inf: all at t=0)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stream-interval", type=int, default=0,
        help="the least tokens per message after the first (0: the router's default)",
    )  # fmt: skip
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    args = p.parse_args(argv)
    requests = make_workload(args.workload, args.num_requests, args.vocab, args.seed)
    requests = with_arrivals(requests, args.rate, args.seed, args.burstiness)
    summary = run_load(
        args.router,
        requests,
        max_concurrency=args.max_concurrency,
        slo=SLO(args.slo_ttft, args.slo_tpot),
        stream_interval=args.stream_interval,
    )
    summary.pop("tokens")
    summary.pop("requests")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
