"""S11 concurrency (docs/benchmarks/method.md): 10 / 100 / 1,000 streams through one router.

One cluster (router, one prefill and one decode worker, each its own process, `start_cluster`),
driven by one asyncio client on one thread, so the client holds 1,000 streams without being the
limit. Every stream asks for exactly `OUTPUT_LEN` tokens (`ignore_eos`). Per level: streams
completed and failed, TTFT p50/p99, useful tok/s, the router's health-check latency (p50/p99/max)
sampled while the streams run, and threads and RSS per process at the start and at the peak.

No peer runs this scenario (its question is whether our servers hold, not how fast another
engine is); the gate (S10) checks a sample of the 100-stream level against transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.bench import gate
from pagedserve.bench.driver import Context
from pagedserve.bench.driver import ScenarioResult as Result
from pagedserve.bench.metrics import percentiles
from pagedserve.bench.workloads import BenchRequest, make_workload
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

OUTPUT_LEN = 16
PROMPT_MAX = 64  # NOTE: short prompts: 1,000 of them must fit the KV budget at once
PROBE_EVERY_S = 0.05


def process_stats(pid: int) -> dict:
    """Threads and RSS (MiB) of a live process, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return {"threads": int(fields["Threads"][0]), "rss_mib": int(fields["VmRSS"][0]) / 1024}


class Sampler:
    """Threads and RSS of each process: at the start and the maximum seen while sampling."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = {name: process_stats(pid) for name, pid in pids.items()}
        self.peak = {name: dict(stats) for name, stats in self.start.items()}

    def sample(self) -> None:
        for name, pid in self.pids.items():
            now = process_stats(pid)
            peak = self.peak[name]
            peak["threads"] = max(peak["threads"], now["threads"])
            peak["rss_mib"] = max(peak["rss_mib"], now["rss_mib"])

    def to_json(self) -> dict:
        return {name: {"start": self.start[name], "peak": self.peak[name]} for name in self.pids}


async def _level(address: str, requests: list[BenchRequest], sampler: Sampler) -> dict:
    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    t0 = time.perf_counter()
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}

    async def stream(req: BenchRequest) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        msg = generation_pb2.GenerateRequest(
            request_id=req.request_id, sampling=sampling_to_proto(params), stream=True
        )
        msg.token_ids.ids.extend(req.prompt)
        out: list[int] = []
        try:
            async for part in stub.Generate(msg, timeout=600):
                if part.token_ids and not out:
                    ttft[req.request_id] = time.perf_counter() - t0
                out.extend(part.token_ids)
        except grpc.aio.AioRpcError as err:
            errors[req.request_id] = err.code().name
        tokens[req.request_id] = out

    tasks = [asyncio.create_task(stream(r)) for r in requests]
    check = health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation")
    health_s: list[float] = []
    health_failures = 0
    while not all(t.done() for t in tasks):
        sampler.sample()
        started = time.perf_counter()
        try:
            await health.Check(check, timeout=5)
            health_s.append(time.perf_counter() - started)
        except grpc.aio.AioRpcError:
            health_failures += 1
        await asyncio.sleep(PROBE_EVERY_S)
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - t0
    await channel.close()
    useful = sum(len(t) for rid, t in tokens.items() if rid not in errors)
    return {
        "streams": len(requests),
        "completed": sum(
            1
            for r in requests
            if r.request_id not in errors and len(tokens[r.request_id]) == r.output_len
        ),
        "failed": len(errors),
        "errors": sorted(set(errors.values())),
        "seconds": seconds,
        "useful_tok_s": useful / seconds,
        "ttft": percentiles(list(ttft.values())),
        "health_s": {
            "p50": statistics.median(health_s) if health_s else None,
            "p99": percentiles(health_s)["p99"] if health_s else None,
            "max": max(health_s, default=None),
            "samples": len(health_s),
            "failures": health_failures,
        },
        "tokens": tokens,
    }


def _requests(n: int, vocab: int, seed: int) -> list[BenchRequest]:
    base = make_workload("random", n, vocab, seed)
    return [
        BenchRequest(f"c{n}-{i}", r.prompt[:PROMPT_MAX], OUTPUT_LEN, 0, 0.0)
        for i, r in enumerate(base)
    ]


def _line(n: int, out: dict) -> str:
    health_ms = 1e3 * (out["health_s"]["p99"] or 0.0)
    processes = ", ".join(
        f"{name} {p['peak']['threads']} threads {p['peak']['rss_mib']:.0f} MiB"
        for name, p in out["processes"].items()
    )
    return (
        f"   {n} streams: {out['completed']} completed, {out['failed']} failed, TTFT p99 "
        f"{out['ttft']['p99']:.3f} s, health p99 {health_ms:.1f} ms; peak: {processes}"
    )


def concurrency(ctx: Context) -> Result:
    from pagedserve.launcher import start_cluster

    res = Result("S11 concurrency")
    levels = (10, 100) if ctx.quick else (10, 100, 1000)
    launch = argparse.Namespace(
        model=ctx.model, host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None,
        block_size=16, dtype=None, kv_cache_memory="512MiB", otlp_traces_endpoint=None,
        metrics=False, start_timeout=180.0, log_dir=None, max_queued_requests=max(levels),
    )  # fmt: skip
    logs = ctx.work / "s11-logs"
    logs.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(launch, logs)
    try:
        pids = {child.name: child.proc.pid for child in cluster.children if child.name != "redis"}
        for n in levels:
            requests = _requests(n, ctx.vocab, 1100 + n)
            sampler = Sampler(pids)
            out = asyncio.run(_level(cluster.router_address, requests, sampler))
            out["processes"] = sampler.to_json()
            tokens = out.pop("tokens")
            if n == 100:
                res.gate = gate.check(ctx.model, requests, tokens, max_tokens=OUTPUT_LEN)
            res.runs[f"streams={n}"] = out
            print(_line(n, out), flush=True)
            if out["failed"]:
                res.notes.append(f"{n} streams: {out['failed']} failed ({out['errors']})")
    finally:
        cluster.stop()
    return res
