"""A forward that raises for one prompt fails that prompt only (a real `PrefillWorker` on the tiny
model, then the real prefill gRPC server in-process on loopback); a dead loop flips health.

The fault: every forward whose batch holds the poisoned request computes, then scribbles NaN over
the new slots of the whole batch and raises, the worst a failed forward can leave behind.

    step 1: | poison 0..128 |                               (budget 128)
    step 2: | poison 128..150 | a 0..40 | b 0..66 |         raises: each prompt then runs alone
    step 3+: b's rest, c, d                                 poison ended, the others finish
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.aio_servers import serving
from support.oracle import hf_greedy, make_prompts
from support.waits import wait_until

from pagedserve.errors import Unavailable
from pagedserve.internal.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import hash_blocks
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.kvstore.transfer import BlockAssembler, BlockChunk
from pagedserve.model.requests.sequence import RequestId, Sequence
from pagedserve.model.runner import ModelRunner, ScheduledSequence
from pagedserve.prefill_worker.convert import Identity
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.server import SERVICE_NAME, build_grpc_server
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.prefill_worker.worker import PrefillFailed, PrefillResult, PrefillWorker
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2
from pagedserve.worker_hooks import NO_HOOKS, WorkerHooks
from pagedserve.worker_server import LoopDeath

BLOCK = 16
CONFIG = PrefillEngineConfig(
    block_size=BLOCK, num_blocks=64, max_num_batched_tokens=128, use_shm=False
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
POISON = "poison"
IDS = (POISON, "a", "b", "c", "d")
PARAMS = {rid: SEEDED if rid == "a" else GREEDY for rid in IDS}  # a completes in the failed step
DECODE_STEPS = 6


def make_worker(model_dir, hooks: WorkerHooks = NO_HOOKS) -> PrefillWorker:
    return PrefillWorker(PrefillEngine.from_model_dir(str(model_dir), CONFIG), hooks)


def workload() -> dict[str, list[int]]:
    """Submitted in this order: poison's second chunk shares a step with a and b's first."""
    return dict(zip(IDS, make_prompts((150, 40, 200, 30, 17), seed=91), strict=True))


def poison(worker: PrefillWorker, monkeypatch, request_id: str = POISON) -> threading.Event:
    """Make every forward holding `request_id` past its first chunk corrupt its batch and raise."""
    original, cache = worker.engine.runner.execute, worker.engine.runner.kv_cache
    raised = threading.Event()

    def execute(batch, **kwargs):
        output = original(batch, **kwargs)
        if any(i.seq.request_id == request_id and i.seq.num_computed_tokens for i in batch):
            for item in batch:
                start = item.seq.num_computed_tokens
                for slot in item.seq.block_table.slot_mapping(start, start + item.num_new_tokens):
                    cache.tensor[slot // BLOCK, :, :, slot % BLOCK] = torch.nan
            raised.set()
            raise RuntimeError("injected prefill fault")
        return output

    monkeypatch.setattr(worker.engine.runner, "execute", execute)
    return raised


def prompt_kv(cache: KVCache, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """[layers, 2, num_tokens, heads, dim]: the prompt's K/V gathered from its blocks."""
    return torch.cat([cache.tensor[b] for b in block_ids], dim=2)[:, :, :num_tokens]


@dataclass(frozen=True)
class Reference:
    first_token: int
    kv: torch.Tensor


@pytest.fixture(scope="module")
def clean(tiny_llama) -> Iterator[dict[str, Reference]]:
    """Each prompt's first token and K/V from a run without the fault."""
    worker = make_worker(tiny_llama)
    worker.start()
    prompts = workload()
    try:
        futures = {rid: worker.submit(rid, p, PARAMS[rid]) for rid, p in prompts.items()}
        references = {}
        for rid, future in futures.items():
            result = future.result(timeout=120)
            assert result.lease is not None
            blocks = list(result.lease.resource.block_ids)
            kv = prompt_kv(worker.engine.runner.kv_cache, blocks, len(prompts[rid])).clone()
            references[rid] = Reference(result.seq.output_token_ids[0], kv)
            assert worker.release(result.lease.handle_id)
        for rid in IDS:  # the reference itself follows transformers
            if PARAMS[rid] is GREEDY:
                want = hf_greedy(tiny_llama, torch.float32, tuple(prompts[rid]))[0][0]
                assert references[rid].first_token == want
        yield references
    finally:
        worker.close()


def assert_like(result: PrefillResult, reference: Reference, cache: KVCache) -> None:
    assert result.seq.output_token_ids == [reference.first_token], result.seq.request_id
    assert result.lease is not None
    got = prompt_kv(cache, list(result.lease.resource.block_ids), reference.kv.shape[2])
    torch.testing.assert_close(got, reference.kv, atol=1e-5, rtol=1e-5)


def test_a_prompt_whose_forward_raises_fails_alone_and_leaves_no_bad_block(
    tiny_llama, clean, monkeypatch
):
    worker = make_worker(tiny_llama)
    prompts = workload()
    try:
        raised = poison(worker, monkeypatch)
        futures = {rid: worker.submit(rid, p, PARAMS[rid]) for rid, p in prompts.items()}
        worker.start()  # NOTE: all five are in flight before the first step
        with pytest.raises(PrefillFailed, match=POISON) as info:
            futures[POISON].result(timeout=120)
        assert info.value.request_id == POISON and raised.is_set()
        results = {rid: futures[rid].result(timeout=120) for rid in IDS[1:]}
        worker.check_integrity()
        cache = worker.engine.runner.kv_cache
        for rid, result in results.items():
            assert_like(result, clean[rid], cache)
        assert not worker.dead

        # the failed chunk's block was never offered to the prefix cache; the first chunk's
        # (computed by a step that succeeded) were, and hold the right K/V (the retry below)
        hashes = hash_blocks(prompts[POISON], BLOCK, model_fingerprint=worker.engine.fingerprint)
        assert [worker.engine.pool.lookup(h) is not None for h in hashes] == [True] * 8 + [False]
        retry = worker.submit("poison-retry", prompts[POISON], GREEDY).result(timeout=120)
        assert retry.seq.num_cached_prompt_tokens == 128
        assert_like(retry, clean[POISON], cache)
        worker.check_integrity()

        for result in [*results.values(), retry]:
            assert result.lease is not None and worker.release(result.lease.handle_id)
        worker.check_integrity()
        assert worker.engine.pool.num_used == 0 and len(worker.engine.scheduler.running) == 0
    finally:
        worker.close()
    worker.engine.pool.check_integrity()


def test_every_prompt_failing_alone_fails_each_by_name_and_frees_everything(
    tiny_llama, monkeypatch
):
    worker = make_worker(tiny_llama)
    try:
        monkeypatch.setattr(worker.engine.runner, "execute", broken_forward)
        prompts = make_prompts((20, 33, 5, 70), seed=92)
        futures = [worker.submit(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        worker.start()
        for i, future in enumerate(futures):
            with pytest.raises(PrefillFailed, match=f"r{i}: "):
                future.result(timeout=60)
        worker.check_integrity()
        assert worker.engine.pool.num_used == 0 and worker.engine.pool.num_cached == 0
        assert not worker.engine.scheduler.has_work() and not worker.dead
    finally:
        worker.close()


def broken_forward(batch, **kwargs):
    raise RuntimeError("the model is broken")


# ---- the real gRPC server, in-process ---------------------------------------------------------


class Server:
    """A started prefill gRPC server on 127.0.0.1 over `worker` (the worker loop not started)."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.servicer = PrefillServicer(worker, Identity("prefill-f", "inc-1", ""))
        self._serving = serving(build_grpc_server(self.servicer))
        self.handle = self._serving.__enter__()
        address = f"127.0.0.1:{self.handle.port}"
        self.servicer.me = Identity("prefill-f", "inc-1", address)
        self.channel = grpc.insecure_channel(address)
        self.stub = prefill_pb2_grpc.PrefillWorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def prefill(self, request_id: str, prompt: list[int]) -> Future:
        request = worker_pb2.WorkerRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY)
        )
        return self.stub.Prefill.future(prefill_pb2.PrefillRequest(request=request), timeout=120)

    def serving(self) -> bool:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        status = self.health.Check(request, timeout=5).status
        return status == health_pb2.HealthCheckResponse.SERVING

    def load(self) -> common_pb2.LoadReport:
        return self.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)

    def wait_queued(self, n: int) -> None:
        assert wait_until(lambda: self.worker.engine.scheduler.num_waiting == n, 10.0), (
            "requests queued: not within 10.0 s"
        )

    def close(self) -> None:
        self.channel.close()
        self._serving.__exit__(None, None, None)
        self.worker.close()


@pytest.fixture
def server(tiny_llama) -> Iterator[Server]:
    death = LoopDeath(threading.Event())  # NOTE: as the server process wires it
    server = Server(make_worker(tiny_llama, WorkerHooks(on_loop_death=death)))
    death.handle = server.handle
    yield server
    server.close()
    server.worker.engine.pool.check_integrity()


def pull(stub, handle: worker_pb2.KvHandle, cache: KVCache, dst: list[int]) -> None:
    request = prefill_pb2.PullKvRequest(
        handle_id=handle.handle_id,
        producer_incarnation=handle.producer_incarnation,
        max_chunk_bytes=5000,
    )
    assembler = BlockAssembler(cache, dict(enumerate(dst)))
    for c in stub.PullKv(request, timeout=30):
        assembler.feed(BlockChunk(c.block_index, c.block_id, c.offset, c.data, c.last_of_block))
    assert assembler.complete


def decode_pulled(runner: ModelRunner, prompt, response, stub) -> list[int]:
    """Pull the prompt's blocks into a fresh pool (garbage elsewhere) and decode greedily."""
    kv = KVCacheManager(BlockPool(runner.kv_cache.num_blocks, BLOCK, record_events=False))
    runner.kv_cache.tensor.normal_()
    table = BlockTable(kv.pool)
    assert kv.allocate(table, len(prompt)) == []
    pull(stub, response.kv_handle, runner.kv_cache, table.block_ids)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1)
    seq = Sequence(RequestId("decode"), list(prompt), params, table, model_fingerprint=b"c")
    seq.num_computed_tokens = len(prompt)  # | prompt: pulled KV | first token: to compute |
    seq.append_token(response.first_token, None)
    while seq.num_output_tokens <= DECODE_STEPS:
        assert kv.allocate(table, seq.num_tokens) == []
        (sampled,) = runner.execute([ScheduledSequence(seq, 1)]).sampled
        assert sampled is not None
        seq.num_computed_tokens += 1
        seq.append_token(sampled.token_id, None)
    kv.free(table)
    kv.check_integrity()
    return seq.output_token_ids


def test_grpc_answers_internal_naming_the_request_and_the_others_decode_right(
    server, tiny_llama, monkeypatch
):
    worker = server.worker
    raised = poison(worker, monkeypatch)
    prompts = workload()
    calls = {rid: server.prefill(rid, p) for rid, p in prompts.items()}
    server.wait_queued(len(prompts))
    worker.start()
    with pytest.raises(grpc.RpcError) as info:
        calls[POISON].result(timeout=120)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert POISON in (info.value.details() or "")
    assert raised.is_set()

    consumer = ModelRunner(worker.engine.model_config, worker.engine.runner.model, 16, BLOCK)
    for rid in IDS[1:]:
        response = calls[rid].result(timeout=120)
        want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompts[rid]))
        assert response.first_token == want[0], rid
        got = decode_pulled(consumer, prompts[rid], response, server.stub)
        assert got == want[: DECODE_STEPS + 1], rid
        found = server.stub.ReleaseKv(
            prefill_pb2.ReleaseKvRequest(handle_id=response.kv_handle.handle_id), timeout=5
        ).found
        assert found
    assert server.serving() and not server.load().draining
    worker.check_integrity()
    assert worker.engine.pool.num_used == 0


def test_a_dead_loop_flips_health_and_fails_every_prompt(server, monkeypatch):
    worker = server.worker

    def explode():
        raise SystemExit("the loop thread is gone")  # not an Exception: the loop cannot go on

    monkeypatch.setattr(worker, "step", explode)
    prompts = make_prompts((9, 40), seed=93)
    calls = [server.prefill(f"doomed{i}", p) for i, p in enumerate(prompts)]
    server.wait_queued(len(prompts))
    assert server.serving()
    worker.start()
    for i, call in enumerate(calls):
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"doomed{i}" in (info.value.details() or "")
    assert wait_until(lambda: not server.serving(), 10.0), "health NOT_SERVING: not within 10.0 s"
    assert worker.dead and server.load().draining
    with pytest.raises(grpc.RpcError) as info:
        server.prefill("late", prompts[0]).result(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Unavailable):
        worker.submit("late", prompts[0], GREEDY)
    worker.check_integrity()
    assert worker.engine.pool.num_used == 0 and not worker.engine.scheduler.has_work()
