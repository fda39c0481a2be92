"""A decode worker in the Redis prefix index (a real in-process `DecodeWorker` joined to a real
redis-server with `join_indexed`, as `pagedserve decode --redis-url` joins): the full blocks it
computes, generated tokens' included, are published under its worker id and incarnation; the
router counts them for the next turn; the entries of an incarnation that died are ignored (and
not counted) once the id re-registers; leaving deletes them. Blocks it imports from a prefill
worker: test_decode_server.py; end to end: tests/router/test_locality_e2e.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.oracle import hf_greedy, make_prompts

from pagedserve.cluster import join_indexed
from pagedserve.decode_worker import convert
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.internal.v1 import decode_pb2, worker_pb2
from pagedserve.kvstore.hashing import hash_blocks
from pagedserve.kvstore.index_publisher import IndexEvents
from pagedserve.kvstore.prefix_index import RedisPrefixIndex, Tier
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect
from pagedserve.protoconv import sampling_to_proto
from pagedserve.router.routing import Decision, RoutingPolicy, WorkerSet
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker_load import WorkerLoad

BLOCK = 16
MODEL = "tiny"
PREFILL, DECODE = "127.0.0.1:1", "127.0.0.1:2"  # the router's static workers: ids = addresses
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TIMEOUT_S = 60


@pytest.fixture
def joined(tiny_llama, redis_server):
    engine = DecodeEngine.from_model_dir(
        str(tiny_llama), DecodeEngineConfig(block_size=BLOCK, num_blocks=64, num_swap_blocks=0)
    )
    events = IndexEvents()
    worker = DecodeWorker(engine, worker_id=DECODE, on_events=events.submit)
    client = connect(redis_server.url)
    member = join_indexed(
        client, MODEL, DECODE, DECODE, Role.DECODE, worker.load, worker, events,
        compat="", incarnation="inc1", block_size=BLOCK,
    )  # fmt: skip
    worker.start()
    yield worker, member, client
    member.leave()
    worker.close()
    engine.check_integrity()
    assert engine.pool.num_used == 0


def run_here(worker: DecodeWorker, request_id: str, prompt: list[int]) -> list[int]:
    """The worker computes `prompt` itself (prefill here) and generates; its tokens."""
    request = worker_pb2.WorkerRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY)
    )
    call = convert.decode_call(decode_pb2.DecodeRequest(request=request, prefill_here=True))
    stream = worker.submit(call)
    tokens: list[int] = []
    while True:
        delta = stream.get(TIMEOUT_S)
        assert delta is not None
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            return tokens


def route(index: RedisPrefixIndex, prompt: list[int], fingerprint: bytes) -> Decision:
    async def scenario() -> Decision:
        workers = WorkerSet([PREFILL], [DECODE], None, max_message_bytes=1 << 20)
        try:
            prefill, decode = workers.workers()
            prefill.load, decode.load = WorkerLoad(), WorkerLoad(accepts_prefill_here=True)
            policy = RoutingPolicy(workers, index, block_size=BLOCK)
            hashes = hash_blocks(prompt, BLOCK, model_fingerprint=fingerprint)
            return policy.choose(hashes, num_tokens=len(prompt))
        finally:
            await workers.close()

    return asyncio.run(scenario())


def first_turn(joined, tiny_llama) -> tuple[list[int], list[int], RedisPrefixIndex]:
    """Turn 1 (40 tokens, 24 generated: 63 tokens' KV, 3 full blocks) and turn 2's prompt."""
    worker, member, client = joined
    prompt, new = make_prompts((40, 10), seed=47)
    answer = run_here(worker, "turn-1", prompt)
    assert answer == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0][:24]
    assert member.publisher.flush(5.0)
    return prompt + answer, prompt + answer + new, RedisPrefixIndex(client, MODEL)


def test_computed_and_generated_blocks_are_published_under_the_incarnation(joined, tiny_llama):
    worker, member, client = joined
    history, turn_2, index = first_turn(joined, tiny_llama)
    fingerprint = worker.engine.fingerprint
    hashes = hash_blocks(history, BLOCK, model_fingerprint=fingerprint)
    assert index.lookup(hashes) == {DECODE: 3}  # the third block holds generated tokens
    assert index.holders(hashes[2]) == {DECODE: Tier.DEV}
    assert client.hget(index.block_key(hashes[2]), DECODE) == b"dev:inc1"
    assert not member.publisher.stale and member.publisher.dropped_events == 0

    decision = route(index, turn_2, fingerprint)
    assert decision.terms["decode_cached_blocks"] == 3.0
    assert decision.prefill_here and decision.terms["prefill_here_locality"]

    member.leave()  # NOTE: the fixture's second leave finds nothing left to do
    assert client.keys(f"ps:{MODEL}:blk:*") == []


def test_a_dead_incarnations_entries_are_ignored_and_not_counted(joined, tiny_llama):
    """A decode worker killed (nothing cleared, nothing deregistered) and restarted under the
    same id: its new incarnation has an empty cache, so the old entries must not count."""
    worker, member, client = joined
    history, turn_2, index = first_turn(joined, tiny_llama)
    fingerprint = worker.engine.fingerprint
    hashes = hash_blocks(history, BLOCK, model_fingerprint=fingerprint)
    member.member.heartbeater.stop()  # NOTE: the killed process beats no more
    member.publisher.stop()
    WorkerRegistry(client, MODEL).register(DECODE, DECODE, Role.DECODE, incarnation="inc2")

    assert index.lookup(hashes) == {}
    assert index.stats.stale_entries_cleaned == 3  # deleted lazily, by the lookup
    decision = route(index, turn_2, fingerprint)
    assert decision.terms["decode_cached_blocks"] == 0.0
    assert not decision.prefill_here
