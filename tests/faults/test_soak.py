"""Bounded soak (issue 10, item 10): 2,000 requests with random client cancels, short deadlines
and random priorities through a real router, then every pool must be exactly at baseline.

    clients (16 threads) ─► router process ─► prefill process (Redis index, leases)
                                          └─► decode worker (in this process, real gRPC server)

The decode worker runs here, behind its real gRPC server, so that its pool, swap space,
scheduler and importer can be checked for integrity afterwards; its KV pool is small (12
blocks; a request needs up to 5), so imports fall back to recompute and sequences are preempted.
Prompts come from 4 shared prefixes (prefix cache hits on both workers) and 5 suffixes each, so
the transformers oracle runs 20 times. Completed outputs must equal it exactly.
"""

from __future__ import annotations

import collections
import itertools
import random
import threading
import time

import grpc
import pytest
import torch
from support.aio_servers import serving
from support.oracle import hf_greedy, make_prompts
from support.ports import free_port
from support.waits import wait_until
from support.workers import start, wait_ready

from pagedserve.client import Client
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.servicer import DecodeServicer
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.grpcutil import build_server
from pagedserve.internal.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from pagedserve.kvstore.worker_registry import WorkerRegistry, connect
from pagedserve.launcher import wait_healthy
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

NUM_REQUESTS = 2000
NUM_CLIENTS = 16
# NOTE: far longer than the test: every lease must be released, none may end by expiry (a
# client cancel right after the first token, before the decode worker has the request, is
# released by the router; one while the Prefill answer is on its way, by the router's Abort;
# anything else by the decode worker).
LEASE_S = 120
SEED = 2010
DONE = (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)


@pytest.fixture(
    params=[
        pytest.param(0, id="recompute-only"),
        pytest.param(8, id="with-swap"),
    ]
)
def soak_cluster(request, tiny_llama, module_redis, tmp_path_factory):
    logs = tmp_path_factory.mktemp("soak-logs")
    common = ["--model", str(tiny_llama), "--block-size", "16", "--redis-url", module_redis.url]
    prefill = start(
        "prefill",
        [*common, "--num-gpu-blocks-override", "96", "--worker-id", "prefill-s",
         "--drain-timeout", "1", "--kv-lease-seconds", str(LEASE_S)],
        logs / "prefill.log",
        metrics_port=free_port(),
    )  # fmt: skip
    engine = DecodeEngine.from_model_dir(
        str(tiny_llama),
        DecodeEngineConfig(
            block_size=16, num_blocks=12, num_swap_blocks=request.param, max_num_seqs=16
        ),
    )
    worker = DecodeWorker(engine, worker_id="decode-s")
    servicer = DecodeServicer(worker)
    worker.start()
    decode = build_server(
        [lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s)],
        ["pagedserve.internal.v1.DecodeWorker"],
    )
    router = None
    with serving(decode) as handle:
        try:
            wait_ready(prefill)
            router = start(
                "router",
                [*common, "--prefill", prefill.address, "--decode", f"127.0.0.1:{handle.port}",
                 "--max-queued-requests", "256", "--drain-timeout", "1"],
                logs / "router.log",
            )  # fmt: skip
            wait_ready(router)
            wait_healthy(router.address, "pagedserve.v1.Generation", 60)
            yield router.address, prefill, worker
        finally:
            for process in (router, prefill):
                if process is not None:
                    process.stop()
    servicer.close()
    worker.close()


def workload(model_dir) -> tuple[list[list[int]], dict[tuple[int, ...], list[int]]]:
    prefixes = make_prompts((32,) * 4, seed=SEED)
    suffix_lens = (3, 7, 12, 16, 20)
    prompts = [
        prefix + suffix
        for i, prefix in enumerate(prefixes)
        for suffix in make_prompts(suffix_lens, seed=SEED + 1 + i)
    ]
    oracle = {tuple(p): hf_greedy(model_dir, torch.float32, tuple(p))[0] for p in prompts}
    return prompts, oracle


def run_one(client: Client, rng: random.Random, prompt: list[int], want: list[int]) -> str:
    """One request, its fault drawn from `rng`; returns its outcome. Fails on a wrong output
    or an unexpected error."""
    max_tokens = rng.choice((4, 8, 16))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    kind = rng.choices(("complete", "cancel", "deadline"), weights=(6, 2, 2))[0]
    timeout = rng.uniform(0.02, 0.3) if kind == "deadline" else 60.0
    cancel_after = rng.randrange(max_tokens)
    stream = client.generate(prompt, params, priority=rng.randint(-3, 3), timeout=timeout)
    tokens: list[int] = []
    try:
        for part in stream:
            tokens += part.token_ids
            if kind == "cancel" and len(tokens) >= cancel_after and not part.finish_reason:
                stream.cancel()
        assert part.finish_reason in DONE, part
    except grpc.RpcError as err:
        expected = {
            "cancel": grpc.StatusCode.CANCELLED,
            "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
        }
        assert err.code() == expected.get(kind), (kind, err.code(), err.details())
        assert tokens == want[: len(tokens)], "a partial output must be a prefix of the oracle's"
        return "cancelled" if kind == "cancel" else "timed out"
    assert tokens == want[:max_tokens], (prompt, tokens, want)
    return "completed"


def redis_entries_of(url: str, model: str, worker_id: str) -> int:
    """`blk:` entries naming `worker_id` with its live incarnation."""
    client = connect(url)
    (info,) = [w for w in WorkerRegistry(client, model).live_workers() if w.worker_id == worker_id]
    return sum(
        client.hget(key, worker_id) == f"dev:{info.incarnation}".encode()
        for key in client.scan_iter(match=f"ps:{model}:blk:*", count=1000)
    )


def test_soak_2000_requests_with_cancels_deadlines_and_priorities_ends_at_baseline(
    soak_cluster, tiny_llama, module_redis
):
    router_address, prefill, worker = soak_cluster
    prompts, oracle = workload(tiny_llama)
    engine = worker.engine
    counter = itertools.count()
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def client_thread() -> None:
        with Client(router_address) as client:
            while (i := next(counter)) < NUM_REQUESTS and not failures:
                rng = random.Random(SEED * 100_000 + i)
                prompt = prompts[rng.randrange(len(prompts))]
                try:
                    outcome = run_one(client, rng, prompt, oracle[tuple(prompt)])
                except Exception as exc:  # noqa: BLE001 - reported by the test thread
                    with lock:
                        failures.append(f"request {i}: {exc!r}")
                    return
                with lock:
                    outcomes[outcome] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    soak_s = time.monotonic() - started
    assert not failures, failures[:5]
    assert sum(outcomes.values()) == NUM_REQUESTS, outcomes

    def decode_at_baseline() -> bool:
        with worker.lock:
            return worker.num_in_flight == 0 and engine.pool.num_used == 0

    assert wait_until(decode_at_baseline, timeout_s=5)
    with worker.lock:
        engine.check_integrity()
        scheduler = engine.scheduler
        assert not (scheduler.waiting or scheduler.running or scheduler.swapped)
        if engine.swap_space is not None:
            assert engine.swap_space.num_free == engine.swap_space.num_blocks
            engine.swap_space.check_integrity()
        assert not worker.importer._in_flight  # noqa: SLF001 - no import left half-done
    assert wait_until(
        lambda: prefill.used_blocks() == 0 and prefill.metric("kv_leases_active") == 0,
        timeout_s=5,
    ), f"leases still held: {prefill.metric('kv_leases_active')}"
    granted = prefill.metric("kv_leases_granted_total")
    expired = prefill.metric("kv_leases_expired_total")
    assert granted == prefill.metric("kv_leases_released_total") > 0 and expired == 0
    model = tiny_llama.name
    # NOTE: the index holds exactly the blocks the prefill worker still caches (published
    # asynchronously, so wait a little): no entry for a block it evicted, none missing
    assert wait_until(
        lambda: redis_entries_of(module_redis.url, model, "prefill-s") == cached_blocks(prefill),
        timeout_s=5,
    ), (redis_entries_of(module_redis.url, model, "prefill-s"), cached_blocks(prefill))
    stats = scheduler.stats
    assert stats.num_preemptions > 0, "the small decode pool must have preempted"
    print(
        f"soak: {NUM_REQUESTS} requests in {soak_s:.1f} s, {dict(outcomes)}; decode preemptions "
        f"swap {stats.num_preemptions_swap} / recompute {stats.num_preemptions_recompute}, "
        f"imports {worker.importer.stats.num_imported} (recomputed "
        f"{worker.importer.stats.num_recomputed}); leases {granted:.0f}, {expired:.0f} expired"
    )


def cached_blocks(prefill) -> int:
    with grpc.insecure_channel(prefill.address) as channel:
        load = prefill_pb2_grpc.PrefillWorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=5
        )
    return load.kv_blocks_cached
