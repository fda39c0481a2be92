"""Routing and validation against real worker processes and a real redis-server.

The router here is the real `GenerationServicer` behind a real gRPC server built in the test
(so the test can count how many calls reached workers); the workers and Redis are processes.
"""

from __future__ import annotations

import argparse
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.in_process_router import serve_router
from support.oracle import make_prompts
from support.waits import wait_until

from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.v1 import common_pb2, generation_pb2


@pytest.fixture(scope="module")
def workers(make_tiny, module_redis, clusters):
    """Two prefill workers and one decode worker (and their router, unused here); private: a
    test here stops their Redis."""
    model_dir = make_tiny("llama")
    with clusters.private(model_dir, prefill=2, redis_url=module_redis.url) as cluster:
        yield cluster, model_dir


@pytest.fixture(scope="module")
def router(workers, module_redis):
    cluster, model_dir = workers
    args = argparse.Namespace(
        model=str(model_dir), served_model_name=None, revision="", dtype=None, block_size=16,
        redis_url=module_redis.url, prefill=[], decode=[], max_queued_requests=64,
        max_message_bytes=16 << 20,
    )  # fmt: skip
    with serve_router(args) as router:
        yield router.servicer, router.stub


def all_routable(servicer) -> bool:
    """Whether the router sees all three workers healthy (a load answered). It is ready with
    one pair; the routing tests need both prefill workers: on a loaded host the second may
    answer its first polls late."""
    workers = servicer.workers.workers()
    return len(workers) == 3 and all(w.healthy for w in workers)


def worker_states(servicer) -> list[tuple]:
    """What routing saw of each worker (a failed routing assertion shows it)."""
    return [
        (w.worker_id, w.load is not None, w.failures, w.stale, w.assigned)
        for w in servicer.workers.workers()
    ] + [("index_degraded", servicer.policy.index_degraded)]


def generate(stub, prompt, **sampling):
    request = generation_pb2.GenerateRequest(stream=True)
    request.token_ids.ids.extend(prompt)
    for key, value in ({"temperature": 0.0, "max_tokens": 4} | sampling).items():
        setattr(request.sampling, key, value)
    return list(stub.Generate(request, timeout=60))


def field_of(err: grpc.RpcError) -> str:
    bad_request = error_details_pb2.BadRequest()
    rpc_status.from_call(err).details[0].Unpack(bad_request)
    return bad_request.field_violations[0].field


BAD = {
    "token_ids": lambda r: r.token_ids.ids.extend([5, 100_000]),
    "text": lambda r: setattr(r, "text", ""),
    "prompt": lambda r: None,
    "sampling.temperature": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r.sampling, "temperature", -1),
    ),  # noqa: E501
    "sampling.top_p": lambda r: (r.token_ids.ids.append(5), setattr(r.sampling, "top_p", 1.5)),
    "sampling.top_k": lambda r: None,
    "sampling.min_p": lambda r: (r.token_ids.ids.append(5), setattr(r.sampling, "min_p", 2.0)),
    "sampling.max_tokens": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r.sampling, "max_tokens", 0),
    ),  # noqa: E501
    "sampling.min_tokens": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r.sampling, "max_tokens", 3),
        setattr(r.sampling, "min_tokens", 9),
    ),  # noqa: E501
    "sampling.repetition_penalty": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r.sampling, "repetition_penalty", 0.0),
    ),  # noqa: E501
    "sampling.presence_penalty": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r.sampling, "presence_penalty", 3.0),
    ),  # noqa: E501
    "sampling.frequency_penalty": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r.sampling, "frequency_penalty", -3.0),
    ),  # noqa: E501
    "sampling.logprobs": lambda r: (r.token_ids.ids.append(5), setattr(r.sampling, "logprobs", 50)),
    "sampling.stop": lambda r: (r.token_ids.ids.append(5), r.sampling.stop.extend(["x"] * 40)),
    "sampling.stop_token_ids": lambda r: (
        r.token_ids.ids.append(5),
        r.sampling.stop_token_ids.append(10**6),
    ),  # noqa: E501
    "request_id": lambda r: (r.token_ids.ids.append(5), setattr(r, "request_id", "x" * 500)),
    "cache_salt": lambda r: (r.token_ids.ids.append(5), setattr(r, "cache_salt", "s" * 1000)),
    "stream_interval": lambda r: (
        r.token_ids.ids.append(5),
        setattr(r, "stream_interval", (1 << 16) + 1),
    ),  # noqa: E501
}
BAD.pop("sampling.top_k")  # uint32 on the wire: nothing to violate


@pytest.mark.parametrize("field", sorted(BAD))
def test_each_bad_field_is_invalid_argument_and_reaches_no_worker(router, field):
    servicer, stub = router
    before = servicer.requests_to_workers
    request = generation_pb2.GenerateRequest()
    BAD[field](request)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(info.value) == field
    assert servicer.requests_to_workers == before


def test_a_prompt_too_long_names_its_field(router):
    _, stub = router
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, [5] * 2048)
    assert field_of(info.value) == "token_ids"
    assert generate(stub, [5, 6, 7])[-1].finish_reason, "the cluster still serves"


def test_prefix_routing_then_degraded_without_redis_then_recovery(router, module_redis):
    servicer, stub = router
    assert wait_until(lambda: all_routable(servicer), timeout_s=30)
    shared = make_prompts((64,), seed=41)[0]
    first = generate(stub, shared + [9])
    holder = _last_prefill(servicer)
    for i in range(3):
        again = generate(stub, shared + [10 + i])
        assert again[-1].usage.cached_prompt_tokens == 64, (holder, worker_states(servicer))
        assert _last_prefill(servicer) == holder
    assert first[-1].usage.cached_prompt_tokens == 0
    assert not servicer.policy.index_degraded

    module_redis.stop()
    try:
        out = generate(stub, shared + [20])
        assert out[-1].finish_reason
        assert servicer.policy.index_degraded
        status = stub.GetClusterStatus(generation_pb2.GetClusterStatusRequest(), timeout=10)
        assert status.index_degraded
    finally:
        module_redis.start()
    deadline = time.monotonic() + 20
    while True:  # the workers republish their blocks once Redis is back
        out = generate(stub, shared + [30])
        if not servicer.policy.index_degraded and out[-1].usage.cached_prompt_tokens == 64:
            break
        assert time.monotonic() < deadline, "routing by prefix did not resume"
        time.sleep(0.5)


def test_unrelated_prompts_spread_over_both_prefill_workers(router):
    servicer, stub = router
    assert wait_until(lambda: all_routable(servicer), timeout_s=30)
    seen = set()
    for seed in range(50, 58):
        generate(stub, make_prompts((40,), seed=seed)[0], max_tokens=2)
        seen.add(_last_prefill(servicer))
    assert len(seen) == 2, worker_states(servicer)


def _last_prefill(servicer) -> str:
    return servicer.last_decision.prefill.worker_id


def test_status_lists_every_worker(router):
    _, stub = router
    status = stub.GetClusterStatus(generation_pb2.GetClusterStatusRequest(), timeout=10)
    roles = sorted(common_pb2.WorkerRole.Name(w.role) for w in status.workers)
    assert roles == ["WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL", "WORKER_ROLE_PREFILL"]


def test_max_tokens_to_fit_gives_the_rest_of_the_context(router):
    _, stub = router
    prompt = make_prompts((2045,), seed=61)[0]  # max_model_len 2048: room for 3 tokens
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, prompt, ignore_eos=True)  # max_tokens 4 does not fit
    assert field_of(info.value) == "sampling.max_tokens"
    request = generation_pb2.GenerateRequest(stream=True, max_tokens_to_fit=True)
    request.token_ids.ids.extend(prompt)
    request.sampling.temperature, request.sampling.ignore_eos = 0.0, True
    last = list(stub.Generate(request, timeout=60))[-1]
    assert last.usage.completion_tokens == 3
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    request.sampling.max_tokens = 2  # a set max_tokens wins
    assert list(stub.Generate(request, timeout=60))[-1].usage.completion_tokens == 2


def test_logprobs_name_their_tokens(router, workers):
    _, stub = router
    tokenizer = RouterTokenizer.from_model_dir(workers[1])
    out = generate(stub, [5, 6, 7], logprobs=2, max_tokens=6)
    entries = [lp for part in out for lp in part.logprobs]
    assert len(entries) == 6
    for lp in entries:
        for entry in (lp.sampled, *lp.top):
            assert entry.token == tokenizer.decode([entry.token_id], skip_special_tokens=False)
        assert len(lp.top) == 2
    assert any(lp.sampled.token for lp in entries)
