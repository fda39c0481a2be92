"""S12 gateway (docs/benchmarks/method.md): the price of the OpenAI-compatible HTTP gateway.

One cluster (`start_cluster` with the gateway: router, one prefill and one decode worker, the
gateway, each its own process). The same workload — N streamed requests at once, token-id
prompts, exactly `output_len` tokens each (`ignore_eos`) — runs through the gRPC API (one
`grpc.aio` client) and through the gateway (the official `openai` package's async client,
`/v1/completions` with `stream: true`), interleaved per repetition. Ratios: gateway ÷ gRPC
useful tok/s (higher is better) and TTFT p50 (lower is better).

The gate: a sample of the gRPC outputs equals transformers (S10), and every HTTP answer's text
equals the gRPC answer's text for the same request (greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from pagedserve.bench import gate
from pagedserve.bench.driver import Context, Ratio
from pagedserve.bench.driver import ScenarioResult as Result
from pagedserve.bench.metrics import percentiles
from pagedserve.bench.workloads import BenchRequest, make_workload
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

SEQUENTIAL = 8  # requests of the one-at-a-time run (the gateway's latency price)


def _summary(seconds: float, ttft: dict[str, float], texts: dict, errors: dict, useful: int):
    return {
        "seconds": seconds,
        "useful_tok_s": useful / seconds,
        "ttft": percentiles(list(ttft.values())),
        "failed": len(errors),
        "errors": sorted(set(errors.values())),
        "texts": texts,
    }


async def _grpc(address: str, requests: list[BenchRequest], at_once: bool, salt: str) -> dict:
    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    ttft: dict[str, float] = {}
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> None:
        started = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        msg = generation_pb2.GenerateRequest(
            request_id=req.request_id,
            sampling=sampling_to_proto(params),
            stream=True,
            cache_salt=salt,
        )
        msg.token_ids.ids.extend(req.prompt)
        out: list[int] = []
        text = []
        try:
            async for part in stub.Generate(msg, timeout=600):
                if part.text:  # NOTE: the first text, as the first SSE chunk carries
                    ttft.setdefault(req.request_id, time.perf_counter() - started)
                out.extend(part.token_ids)
                text.append(part.text)
        except grpc.aio.AioRpcError as err:
            errors[req.request_id] = err.code().name
        tokens[req.request_id] = out
        texts[req.request_id] = "".join(text)

    await _run(one, requests, at_once)
    seconds = time.perf_counter() - t0
    await channel.close()
    useful = sum(len(t) for rid, t in tokens.items() if rid not in errors)
    return _summary(seconds, ttft, texts, errors, useful) | {"tokens": tokens}


async def _http(
    url: str, model: str, requests: list[BenchRequest], at_once: bool, salt: str
) -> dict:
    import openai

    ttft: dict[str, float] = {}
    texts: dict[str, str] = {}
    errors: dict[str, str] = {}
    useful = 0
    t0 = time.perf_counter()
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600
    ) as client:

        async def one(req: BenchRequest) -> None:
            nonlocal useful
            started = time.perf_counter()
            text = []
            try:
                stream = await client.completions.create(
                    model=model, prompt=req.prompt, max_tokens=req.output_len, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "cache_salt": salt},
                )  # fmt: skip
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        ttft.setdefault(req.request_id, time.perf_counter() - started)
                        text.append(chunk.choices[0].text)
                    if chunk.usage is not None:
                        useful += chunk.usage.completion_tokens
            except openai.APIError as err:
                errors[req.request_id] = type(err).__name__
            texts[req.request_id] = "".join(text)

        await _run(one, requests, at_once)
    return _summary(time.perf_counter() - t0, ttft, texts, errors, useful)


async def _run(one, requests: list[BenchRequest], at_once: bool) -> None:
    """All requests at once (throughput), or one after another (per-request latency)."""
    if at_once:
        await asyncio.gather(*(one(r) for r in requests))
    else:
        for req in requests:
            await one(req)


def _requests(n: int, vocab: int, seed: int) -> list[BenchRequest]:
    return [
        BenchRequest(f"g{seed}-{i}", r.prompt, min(r.output_len, 64))
        for i, r in enumerate(make_workload("random", n, vocab, seed))
    ]


def gateway(ctx: Context) -> Result:
    from pagedserve.launcher import start_cluster

    res = Result("S12 gateway")
    n = ctx.n(16, 64)
    launch = argparse.Namespace(
        model=ctx.model, host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None,
        block_size=16, dtype=None, kv_cache_memory="512MiB", otlp_traces_endpoint=None,
        metrics=False, start_timeout=180.0, log_dir=None, max_queued_requests=4 * n,
        http_port=0,
    )  # fmt: skip
    logs = ctx.work / "s12-logs"
    logs.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(launch, logs)
    model = (
        generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.router_address))
        .GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        .model_name
    )
    ratios: dict[str, list[float]] = {"tok_s": [], "ttft": []}
    try:
        warm = _requests(2, ctx.vocab, 1200)
        asyncio.run(_grpc(cluster.router_address, warm, True, "warm-grpc"))
        asyncio.run(_http(cluster.http_url, model, warm, True, "warm-http"))
        for rep in range(ctx.reps):
            requests = _requests(n, ctx.vocab, 1201 + rep)
            runs = _both(cluster, model, requests, rep, at_once=True)
            _record(res, f"rep={rep}", requests, runs, ctx.model if rep == 0 else None)
            if not (runs["grpc"]["failed"] or runs["http"]["failed"]):
                ratios["tok_s"].append(runs["http"]["useful_tok_s"] / runs["grpc"]["useful_tok_s"])
            one_by_one = requests[:SEQUENTIAL]
            runs = _both(cluster, model, one_by_one, rep, at_once=False)
            _record(res, f"rep={rep} one at a time", one_by_one, runs, None)
            if not (runs["grpc"]["failed"] or runs["http"]["failed"]):
                http_ttft, grpc_ttft = (
                    runs["http"]["ttft"]["median"],
                    runs["grpc"]["ttft"]["median"],
                )
                ratios["ttft"].append(http_ttft / grpc_ttft)
    finally:
        cluster.stop()
    res.ratios.append(
        Ratio(res.name, f"gateway / gRPC useful tok/s ({n} at once)", ratios["tok_s"],
              goal="the gateway's price")
    )  # fmt: skip
    res.ratios.append(
        Ratio(res.name, "gateway / gRPC TTFT p50 (one at a time)", ratios["ttft"],
              goal="the gateway's price", higher_is_better=False)
    )  # fmt: skip
    return res


def _both(cluster, model: str, requests: list[BenchRequest], rep: int, *, at_once: bool) -> dict:
    """The requests through gRPC and through the gateway, in alternating order per rep."""
    runs: dict[str, dict] = {}
    for api in ("grpc", "http") if rep % 2 == 0 else ("http", "grpc"):
        salt = f"{api}-{rep}-{at_once}"  # NOTE: no prefix-cache hits across the runs
        if api == "grpc":
            runs[api] = asyncio.run(_grpc(cluster.router_address, requests, at_once, salt))
        else:
            runs[api] = asyncio.run(_http(cluster.http_url, model, requests, at_once, salt))
    label = f"{len(requests)} at once" if at_once else f"{len(requests)} one at a time"
    print(f"   rep {rep}, {label}: {_line(runs)}", flush=True)
    return runs


def _record(
    res: Result, key: str, requests: list[BenchRequest], runs: dict[str, dict], model: str | None
) -> None:
    """Keep the run; the gate checks the gRPC tokens against transformers (when `model`) and
    every HTTP text against the gRPC text."""
    tokens = runs["grpc"].pop("tokens")
    grpc_texts, http_texts = runs["grpc"].pop("texts"), runs["http"].pop("texts")
    differ = [r.request_id for r in requests if grpc_texts.get(r.request_id)
              != http_texts.get(r.request_id)]  # fmt: skip
    if model is not None:
        res.gate = gate.check(model, requests, tokens, max_tokens=32)
    if differ:
        res.gate["passed"] = False
        res.notes.append(f"{key}: {len(differ)} HTTP answers differ from gRPC: {differ[:5]}")
    for api, run in runs.items():
        if run["failed"]:
            res.notes.append(f"{key}: {api}: {run['failed']} failed ({run['errors']})")
    res.runs[key] = runs


def _line(runs: dict[str, dict]) -> str:
    parts = []
    for api, run in runs.items():
        failed = f" ({run['failed']} failed)" if run["failed"] else ""
        parts.append(
            f"{api} {run['useful_tok_s']:.0f} tok/s TTFT p50 {run['ttft']['median']:.3f} s{failed}"
        )
    return ", ".join(parts)
