"""The prefill worker as a real process: `pagedserve prefill` with a real redis-server, driven
over gRPC on loopback. One worker (started with a warm-up file) serves the whole module; every
test releases what it leases, and a fixture checks that no block stays used after each test."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prefill_process import (
    BLOCK_SIZE,
    MODEL_NAME,
    WorkerProcess,
    prefill,
    pull_over_grpc,
    pull_request,
    read_over_shm,
    start_worker,
    used_blocks,
)
from support.oracle import hf_greedy, make_prompts
from support.waits import wait_until
from transformers import AutoTokenizer

from pagedserve.internal.v1 import prefill_pb2, worker_pb2
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import hash_blocks, model_fingerprint_from_dir
from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.requests.sequence import RequestId, Sequence
from pagedserve.model.runner import ModelRunner, ScheduledSequence
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

SYSTEM_PROMPT = "You are a careful assistant. Answer in one short sentence and name your source."
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def worker(tiny_llama, module_redis, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prefill")
    warmup = workdir / "system_prompts.txt"
    warmup.write_text(f"{SYSTEM_PROMPT}\n\n")
    worker = start_worker(
        tiny_llama, module_redis.url, workdir, "prefill-a",
        "--num-gpu-blocks-override", "128", "--warmup-prompts", str(warmup),
    )  # fmt: skip
    yield worker
    worker.close()


@pytest.fixture(autouse=True)
def nothing_stays_leased(request):
    yield
    if "worker" in request.fixturenames:
        stub = request.getfixturevalue("worker").stub
        assert used_blocks(stub) == 0, "a test left blocks leased"


@pytest.fixture(scope="module")
def index(module_redis) -> RedisPrefixIndex:
    return RedisPrefixIndex(connect(module_redis.url), MODEL_NAME)


@dataclass
class Consumer:
    """A fresh pool on the foundation runner: what a decode worker does with pulled blocks."""

    runner: ModelRunner
    kv: KVCacheManager

    def decode(self, prompt: list[int], first_token: int, fill) -> list[int]:
        """Allocate the prompt's blocks, `fill(block_ids)` them, then decode greedily."""
        table = BlockTable(self.kv.pool)
        assert self.kv.allocate(table, len(prompt)) == []
        fill(table.block_ids)
        params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1)
        seq = Sequence(RequestId("decode"), list(prompt), params, table, model_fingerprint=b"c")
        seq.num_computed_tokens = len(prompt)  # | prompt: pulled KV | first token: to compute |
        seq.append_token(first_token, None)
        try:
            while seq.num_output_tokens <= DECODE_STEPS:
                assert self.kv.allocate(table, seq.num_tokens) == []
                (sampled,) = self.runner.execute([ScheduledSequence(seq, 1)]).sampled
                assert sampled is not None
                seq.num_computed_tokens += 1
                seq.append_token(sampled.token_id, None)
        finally:
            self.kv.free(table)
            self.kv.check_integrity()
        return seq.output_token_ids


@pytest.fixture(scope="module")
def consumer(tiny_llama) -> Consumer:
    config = load_model_config(tiny_llama)
    pool = BlockPool(16, BLOCK_SIZE, record_events=False)
    runner = ModelRunner(config, load_model(config, "cpu"), 16, BLOCK_SIZE)
    runner.kv_cache.tensor.normal_()  # NOTE: garbage, so only pulled bytes can decode right
    return Consumer(runner, KVCacheManager(pool))


def release(stub, handle: worker_pb2.KvHandle) -> bool:
    request = prefill_pb2.ReleaseKvRequest(handle_id=handle.handle_id)
    return stub.ReleaseKv(request, timeout=5).found


def rpc_code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_prefill_hands_out_a_lease_readable_by_shm_and_grpc(worker, tiny_llama, module_redis):
    stub = worker.stub
    (prompt,) = make_prompts((40,), seed=21)
    before = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    response = prefill(stub, "r1", prompt)
    want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
    assert response.first_token == want[0]
    handle = response.kv_handle
    assert (handle.num_tokens, len(handle.block_ids), len(handle.block_hashes)) == (40, 3, 2)
    assert handle.producer_id == worker.worker_id
    assert handle.lease_expires_unix_ms > time.time() * 1000
    assert used_blocks(stub) == 3

    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    by_shm, by_grpc = KVCache(spec, 3), KVCache(spec, 3)
    read_over_shm(handle, by_shm, {0: 0, 1: 1, 2: 2})
    pull_over_grpc(stub, handle, by_grpc, {0: 0, 1: 1, 2: 2})
    assert torch.equal(by_shm.tensor, by_grpc.tensor) and by_shm.tensor.abs().sum() > 0

    # the full blocks are in the Redis index under this worker
    index = RedisPrefixIndex(connect(module_redis.url), MODEL_NAME)
    assert wait_until(
        lambda: index.lookup(list(handle.block_hashes)) == {worker.worker_id: 2}, 10.0
    ), "condition not met within 10.0s"
    registry = WorkerRegistry(connect(module_redis.url), MODEL_NAME)
    assert [w.worker_id for w in registry.live_workers(Role.PREFILL)] == [worker.worker_id]

    renewed = stub.RenewLease(
        prefill_pb2.RenewLeaseRequest(handle_id=handle.handle_id, extend_seconds=60), timeout=5
    )
    assert renewed.lease_expires_unix_ms > handle.lease_expires_unix_ms
    assert release(stub, handle)
    assert not release(stub, handle)
    assert rpc_code(lambda: list(stub.PullKv(pull_request(handle), timeout=5))) == (
        grpc.StatusCode.NOT_FOUND
    )
    after = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert after.kv_blocks_cached == before.kv_blocks_cached + 2
    assert after.kv_blocks_free == before.kv_blocks_free - 2

    again = prefill(stub, "r2", prompt)
    assert again.cached_tokens == 32 and again.computed_tokens == 8
    assert again.first_token == response.first_token
    assert release(stub, again.kv_handle)


def test_pulled_blocks_decode_like_transformers_over_both_transports(worker, tiny_llama, consumer):
    stub = worker.stub
    (prompt,) = make_prompts((40,), seed=23)
    want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
    # NOTE: four decodes read the lease; on a loaded machine they can outlast the default 30 s
    response = prefill(stub, "decode-me", prompt, lease_seconds=300)
    handle, cache = response.kv_handle, consumer.runner.kv_cache
    assert response.first_token == want[0]

    def by_shm(dst: list[int]) -> None:
        read_over_shm(handle, cache, dict(enumerate(dst)))

    def by_grpc(dst: list[int]) -> None:
        pull_over_grpc(stub, handle, cache, dict(enumerate(dst)))

    def head_by_shm_rest_by_grpc(dst: list[int]) -> None:
        # NOTE: a consumer that already holds the first block pulls only the others
        read_over_shm(handle, cache, {0: dst[0]})
        pull_over_grpc(stub, handle, cache, {1: dst[1], 2: dst[2]})

    for fill in (by_shm, by_grpc, head_by_shm_rest_by_grpc):
        got = consumer.decode(prompt, response.first_token, fill)
        assert got == want[: DECODE_STEPS + 1], fill.__name__

    def nothing(dst: list[int]) -> None:
        for block_id in dst:
            cache.tensor[block_id].zero_()

    assert consumer.decode(prompt, response.first_token, nothing) != want[: DECODE_STEPS + 1]
    assert release(stub, handle)


def test_a_shared_prefix_is_computed_once_and_indexed_once(worker, module_redis):
    stub = worker.stub
    prefix, tail_a, tail_b = make_prompts((48, 10, 20), seed=24)
    first = prefill(stub, "share-a", prefix + tail_a)
    second = prefill(stub, "share-b", prefix + tail_b)
    assert (first.cached_tokens, first.computed_tokens) == (0, 58)
    assert (second.cached_tokens, second.computed_tokens) == (48, 20)
    a, b = first.kv_handle, second.kv_handle
    assert a.block_hashes[:3] == b.block_hashes[:3] and a.block_ids[:3] == b.block_ids[:3]
    assert used_blocks(stub) == 4 + 2  # 3 shared + a's tail, b's 2 tail blocks

    index = RedisPrefixIndex(connect(module_redis.url), MODEL_NAME)
    hashes = list(dict.fromkeys([*a.block_hashes, *b.block_hashes]))  # 3 shared + b's 4th
    assert len(hashes) == 4
    client = module_redis.client()
    entry = f"dev:{a.producer_incarnation}".encode()

    def each_hash_once() -> bool:
        rows = [client.hgetall(index.block_key(h)) for h in hashes]
        return all(row == {worker.worker_id.encode(): entry} for row in rows)

    assert wait_until(each_hash_once, 10.0), (
        "one entry per hash, under this worker not met within 10.0s"
    )
    assert release(stub, a) and release(stub, b)


def test_lease_release_expiry_renewal_and_a_retry_that_hits(worker):
    stub = worker.stub
    pa, pb, pc = make_prompts((40, 40, 40), seed=25)
    ha = prefill(stub, "lease-a", pa).kv_handle  # the default 30 s lease
    assert used_blocks(stub) == 3
    assert release(stub, ha)
    assert used_blocks(stub) == 0, "release frees at once"
    assert rpc_code(lambda: list(stub.PullKv(pull_request(ha), timeout=5))) == (
        grpc.StatusCode.NOT_FOUND
    )

    hb = prefill(stub, "lease-b", pb, lease_seconds=1).kv_handle
    hc = prefill(stub, "lease-c", pc, lease_seconds=1).kv_handle
    renew = prefill_pb2.RenewLeaseRequest(handle_id=hc.handle_id, extend_seconds=30)
    assert stub.RenewLease(renew, timeout=5).lease_expires_unix_ms > hc.lease_expires_unix_ms + 20e3
    if time.time() * 1000 < hb.lease_expires_unix_ms - 100:
        assert used_blocks(stub) == 6, "nothing is freed before the deadline"

    assert wait_until(lambda: used_blocks(stub) == 3, 5), "b's lease reaped not met within 5s"
    assert time.time() * 1000 >= hb.lease_expires_unix_ms - 50, "freed before its deadline"
    expired = grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_code(lambda: list(stub.PullKv(pull_request(hb), timeout=5))) == expired
    renew_b = prefill_pb2.RenewLeaseRequest(handle_id=hb.handle_id, extend_seconds=30)
    assert rpc_code(lambda: stub.RenewLease(renew_b, timeout=5)) == expired
    assert len(list(stub.PullKv(pull_request(hc), timeout=5))) > 0, "renewal kept c alive"
    assert release(stub, hc)

    unknown = worker_pb2.KvHandle(handle_id="0" * 32, producer_incarnation=hc.producer_incarnation)
    assert rpc_code(lambda: list(stub.PullKv(pull_request(unknown), timeout=5))) == (
        grpc.StatusCode.NOT_FOUND
    )
    wrong_incarnation = worker_pb2.KvHandle(handle_id=hc.handle_id, producer_incarnation="x")
    assert rpc_code(lambda: list(stub.PullKv(pull_request(wrong_incarnation), timeout=5))) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )

    retry = prefill(stub, "lease-b-again", pb)
    assert retry.cached_tokens == 32, "expired blocks went back to the prefix cache"
    assert release(stub, retry.kv_handle)


def test_warmup_prompts_file_is_cached_and_published_before_ready(worker, tiny_llama, index):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama), local_files_only=True)
    system = tokenizer(SYSTEM_PROMPT)["input_ids"]
    fingerprint = model_fingerprint_from_dir(tiny_llama, dtype="float32")
    hashes = hash_blocks(system, BLOCK_SIZE, model_fingerprint=fingerprint)
    assert len(hashes) >= 2
    assert index.lookup(hashes) == {worker.worker_id: len(hashes)}

    (user,) = make_prompts((9,), seed=26)
    response = prefill(worker.stub, "after-warmup", system + user)
    assert response.cached_tokens == len(hashes) * BLOCK_SIZE
    assert list(response.kv_handle.block_hashes[: len(hashes)]) == hashes
    assert release(worker.stub, response.kv_handle)


def test_warmup_rpc_caches_salted_blocks_and_publishes_them(worker, index):
    stub = worker.stub
    system, user = make_prompts((50, 7), seed=27)
    warm = prefill_pb2.WarmupRequest(
        prompts=[common_pb2.TokenIds(ids=system)], cache_salt="tenant-a"
    )
    assert stub.Warmup(warm, timeout=30).blocks_cached == 3
    assert stub.Warmup(warm, timeout=30).blocks_cached == 3, "already cached: still counted"

    unsalted = prefill(stub, "other-tenant", system + user)
    salted = prefill(stub, "tenant-a", system + user, cache_salt="tenant-a")
    assert unsalted.cached_tokens == 0
    assert salted.cached_tokens == 48
    hashes = list(salted.kv_handle.block_hashes[:3])
    assert wait_until(lambda: index.lookup(hashes) == {worker.worker_id: 3}, 10.0), (
        "condition not met within 10.0s"
    )
    assert release(stub, unsalted.kv_handle) and release(stub, salted.kv_handle)


def test_bad_request_is_invalid_argument_naming_the_field(worker):
    stub = worker.stub
    with pytest.raises(grpc.RpcError) as info:
        prefill(stub, "bad", [1, 2, 3], top_p=2.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    rpc_status.from_call(info.value).details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "top_p"
    assert rpc_code(lambda: prefill(stub, "", [1, 2, 3])) == grpc.StatusCode.INVALID_ARGUMENT
    bad_warmup = prefill_pb2.WarmupRequest(prompts=[common_pb2.TokenIds(ids=[])])
    assert rpc_code(lambda: stub.Warmup(bad_warmup, timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_sigterm_drains_leaves_redis_and_removes_the_segment(
    tiny_llama, redis_server, tmp_path: Path
):
    own: WorkerProcess = start_worker(tiny_llama, redis_server.url, tmp_path, "prefill-b")
    try:
        (prompt,) = make_prompts((40,), seed=22)
        handle = prefill(own.stub, "r", prompt).kv_handle
        index = RedisPrefixIndex(connect(redis_server.url), MODEL_NAME)
        assert wait_until(
            lambda: index.lookup(list(handle.block_hashes)) == {own.worker_id: 2}, 10.0
        ), "condition not met within 10.0s"
        segment = handle.shm.segment_name
        assert os.path.exists(f"/dev/shm/{segment}")
        own.proc.send_signal(signal.SIGTERM)
        assert own.proc.wait(timeout=20) == 0
        assert not os.path.exists(f"/dev/shm/{segment}")
        registry = WorkerRegistry(connect(redis_server.url), MODEL_NAME)
        assert registry.live_workers(Role.PREFILL) == []
        client = redis_server.client()
        assert not any(client.exists(index.block_key(h)) for h in handle.block_hashes)
    finally:
        own.close()
