"""The prefill worker and Redis under stress: eviction under memory pressure deletes index
entries, and a Redis crash never fails a prefill (the worker re-registers and republishes when
Redis is back). One small-pool worker with a fast heartbeat serves the module."""

from __future__ import annotations

import pytest
import torch
from prefill_process import MODEL_NAME, prefill, start_worker, used_blocks
from support.oracle import hf_greedy, make_prompts
from support.waits import wait_until

from pagedserve.internal.v1 import prefill_pb2
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect

NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def worker(tiny_llama, module_redis, tmp_path_factory):
    worker = start_worker(
        tiny_llama, module_redis.url, tmp_path_factory.mktemp("prefill"), "prefill-small",
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--heartbeat-interval", "0.1",
        "--worker-ttl", "3",
    )  # fmt: skip
    yield worker
    worker.close()


def release(worker, response) -> None:
    request = prefill_pb2.ReleaseKvRequest(handle_id=response.kv_handle.handle_id)
    assert worker.stub.ReleaseKv(request, timeout=5).found


def test_eviction_under_memory_pressure_removes_the_evicted_hashes(worker, module_redis):
    index = RedisPrefixIndex(connect(module_redis.url), MODEL_NAME)
    client = module_redis.client()
    a_prompt, b_prompt = make_prompts((49, 97), seed=31)  # 4 blocks (3 full), 7 blocks (6 full)
    a = prefill(worker.stub, "a", a_prompt)
    release(worker, a)  # a's 3 full blocks stay cached; its tail goes to the free list
    a_hashes = list(a.kv_handle.block_hashes)
    assert wait_until(lambda: index.lookup(a_hashes) == {worker.worker_id: 3}, 10.0), (
        "a published not met within 10.0s"
    )

    # 8 blocks: 5 free + 3 cached; b needs 7, so two of a's cached blocks are evicted. NOTE: a
    # table frees tail first, so a's tail is least recently used and goes first.
    b = prefill(worker.stub, "b", b_prompt)
    assert used_blocks(worker.stub) == 7
    b_hashes = list(b.kv_handle.block_hashes)

    def evicted_hashes_gone() -> bool:
        return not client.exists(*(index.block_key(h) for h in a_hashes[1:]))

    assert wait_until(evicted_hashes_gone, 10.0), (
        "evicted hashes removed from Redis not met within 10.0s"
    )
    assert index.lookup(a_hashes) == {worker.worker_id: 1}
    assert wait_until(lambda: index.lookup(b_hashes) == {worker.worker_id: 6}, 10.0), (
        "b published not met within 10.0s"
    )
    release(worker, b)

    retry = prefill(worker.stub, "a-again", a_prompt)
    assert retry.cached_tokens == 16, "only a's surviving head block hits"
    release(worker, retry)
    assert used_blocks(worker.stub) == 0


def test_a_redis_crash_never_fails_a_prefill_and_the_worker_rejoins(
    worker, module_redis, tiny_llama
):
    registry = WorkerRegistry(connect(module_redis.url), MODEL_NAME)
    (me,) = registry.live_workers(Role.PREFILL)
    prompts = make_prompts((40, 33, 20), seed=32)

    module_redis.stop()
    responses = [prefill(worker.stub, f"outage-{i}", p) for i, p in enumerate(prompts)]
    for prompt, response in zip(prompts, responses, strict=True):
        assert response.first_token == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0][0]
        release(worker, response)

    module_redis.start()  # a fresh, empty server on the same port
    index = RedisPrefixIndex(connect(module_redis.url), MODEL_NAME)
    hashes = [list(r.kv_handle.block_hashes) for r in responses]

    def rejoined() -> bool:
        alive = {w.worker_id: w.incarnation for w in registry.live_workers(Role.PREFILL)}
        return alive == {me.worker_id: me.incarnation} and all(
            index.lookup(h) == {me.worker_id: len(h)} for h in hashes
        )

    assert wait_until(rejoined, 10), "re-registered and republished not met within 10s"
    after = prefill(worker.stub, "after-outage", prompts[0])
    assert after.cached_tokens == 32
    release(worker, after)
