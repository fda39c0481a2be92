"""Tensor parallelism through real processes (redis-server, router, and prefill and decode
workers started as `pagedserve up --tensor-parallel-size 2` starts them, each worker with one
more rank process): greedy output equals transformers' and a one-rank in-process run, every
prompt's KV handed off (none recomputed), each rank's shard pulled once and no more bytes moved
than with one rank; killing a worker's rank turns its health NOT_SERVING within seconds and the
worker then exits (code 1), and no rank process outlives the cluster."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.oracle import hf_greedy_on, hf_model, make_prompts
from support.probes import child, generate_each
from support.processes import alive
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.model.config import load_model_config
from pagedserve.model.runner import kv_cache_spec
from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENS = (5, 17, 33, 64)  # blocks of 16: 1 + 2 + 3 + 4 handed off


def rank_pids(parent: int) -> list[int]:
    """The tensor-parallel rank processes a worker spawned (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


SERVICES = {
    "decode": "pagedserve.internal.v1.DecodeWorker",
    "prefill": "pagedserve.internal.v1.PrefillWorker",
}


GONE = -1  # the server no longer answers


def readiness(address: str, role: str) -> int:
    """A worker's service health (readiness; "" is the process's liveness), or GONE."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=SERVICES[role])
        try:
            return stub.Check(request, timeout=2).status
        except grpc.RpcError as exc:
            # NOTE: a server stopping cancels the calls it holds: CANCELLED is going, too
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                return GONE
            raise


def tp_cluster(make_tiny, clusters, kv_heads: int):
    """A private cluster: the dead-rank test kills ranks."""
    model_dir = make_tiny("llama", heads=4, kv_heads=kv_heads)
    # every prompt through the prefill worker, so every prompt's KV is handed off
    flags = dict(metrics=True, tensor_parallel_size=2, max_local_prefill_tokens=0)
    with clusters.private(model_dir, **flags) as started:
        ranks = {name: rank_pids(child(started, name).proc.pid) for name in ("prefill", "decode")}
        yield started, model_dir, ranks
    deadline = time.monotonic() + 15
    while any(alive(p) for pids in ranks.values() for p in pids):
        assert time.monotonic() < deadline, "a rank process outlived its worker"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(make_tiny, clusters):
    """Two KV heads: one per rank."""
    yield from tp_cluster(make_tiny, clusters, kv_heads=2)


@pytest.fixture(scope="module")
def cluster_one_kv_head(make_tiny, clusters):
    """One KV head: each rank holds it (replicated); a hand-off pulls it once."""
    yield from tp_cluster(make_tiny, clusters, kv_heads=1)


@pytest.mark.parametrize("which", ["cluster", "cluster_one_kv_head"])
def test_two_ranks_on_each_side_equal_transformers_with_every_prompt_handed_off(request, which):
    started, model_dir, ranks = request.getfixturevalue(which)
    assert all(len(pids) == 1 for pids in ranks.values()), ranks
    prompts = make_prompts(LENS, seed=21)
    want = [hf_greedy_on(hf_model(model_dir, torch.float32), p, NEW_TOKENS) for p in prompts]
    got, grew = generate_each(started, prompts, GREEDY)
    assert got == want
    delta = lambda name: grew.get(name, 0)  # noqa: E731
    assert delta("pagedserve:kv_import_num_recomputed_total") == 0
    assert delta("pagedserve:kv_import_num_imported_total") == len(prompts)
    # each rank's shard once (half the KV heads each; or the one head, replicated, once): the
    # bytes one rank would have moved
    whole = kv_cache_spec(load_model_config(model_dir), 16).bytes_per_block
    assert delta("pagedserve:kv_transfer_bytes_shm_total") == (1 + 2 + 3 + 4) * whole
    # each worker says its count, so a router pairs only equal counts (routing.py)
    with Client(started.router_address) as client:
        assert {w.load.tensor_parallel_size for w in client.status().workers} == {2}


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_dead_rank_turns_its_worker_not_serving(cluster, role):
    started, _, ranks = cluster
    worker = child(started, role)
    assert readiness(worker.address, role) == health_pb2.HealthCheckResponse.SERVING
    [rank] = ranks[role]
    os.kill(rank, signal.SIGKILL)
    start = time.monotonic()
    not_serving = (health_pb2.HealthCheckResponse.NOT_SERVING, GONE)
    assert wait_until(lambda: readiness(worker.address, role) in not_serving, 10), (
        "condition not met in time"
    )
    assert time.monotonic() - start < 10
    # then it stops (so that `up` or Kubernetes starts it afresh), failing loudly
    assert worker.proc.wait(timeout=30) == 1
