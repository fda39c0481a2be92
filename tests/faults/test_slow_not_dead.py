"""Slow is not dead: a worker leaves the routing set on a failed connection (or NOT_SERVING),
never because its GetLoad answers late; a request that finds no ready pair waits for one (up to
`--route-wait-timeout`, within its deadline) instead of failing at once.

Real processes: one prefill and one decode worker; the decode worker is reached through
tests/faults/proxy.py (delay / reset); an in-process router over them (to drive its polls).
"""

from __future__ import annotations

import argparse
import threading
import time

import grpc
import pytest
from proxy import PASS, RESET, FaultProxy, delay
from support.in_process_router import serve_router
from support.oracle import make_prompts
from support.waits import wait_until
from support.workers import start, wait_ready

from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
ROUTE_WAIT_S = 2.0
PROMPT = make_prompts((12,), seed=7)[0]


@pytest.fixture(scope="module")
def workers(make_tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("slow-logs")
    common = ["--model", str(make_tiny("llama")), "--num-gpu-blocks-override", "128"]
    procs = [
        start("prefill", common, logs / "prefill.log"),
        start("decode", common, logs / "d.log"),
    ]
    try:
        prefill, decode = (wait_ready(p) for p in procs)
        host, port = decode.address.rsplit(":", 1)
        with FaultProxy((host, int(port)), max_life_s=240) as proxy:
            yield make_tiny("llama"), prefill.address, proxy
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def router(workers):
    model, prefill, proxy = workers
    proxy.set_mode(PASS)
    args = argparse.Namespace(
        model=str(model), served_model_name=None, revision="", dtype=None, block_size=16,
        redis_url=None, prefill=[prefill], decode=[proxy.address], max_queued_requests=8,
        max_message_bytes=16 << 20, route_wait_timeout=ROUTE_WAIT_S,
    )  # fmt: skip
    with serve_router(args) as router:
        yield router, proxy, router.stub
        proxy.set_mode(PASS)


def generate(stub, timeout: float = 60) -> list[int]:
    msg = generation_pb2.GenerateRequest(sampling=sampling_to_proto(GREEDY))
    msg.token_ids.ids.extend(PROMPT)
    return [t for part in stub.Generate(msg, timeout=timeout) for t in part.token_ids]


def decode_worker(worker_set):
    (decode,) = [w for w in worker_set.workers() if w.role.name == "DECODE"]
    return decode


def test_slow_load_polls_keep_the_worker_routable_with_its_last_load(router):
    worker_set, proxy, stub = router
    want = generate(stub)
    proxy.set_mode(delay(800))  # every GetLoad now answers after the 0.5 s poll timeout
    worker_set.refresh()
    worker = decode_worker(worker_set)
    assert worker.stale and worker.healthy and worker.load is not None
    assert generate(stub) == want  # slow, and still served
    # the next polls wait longer for it (up to 4 s): a worker this busy is still seen
    assert wait_until(lambda: refreshed(worker_set) and not decode_worker(worker_set).stale, 10.0)
    assert decode_worker(worker_set).poll_timeout_s >= 1.0
    proxy.set_mode(PASS)  # NOTE: bytes already delayed still arrive late: poll until fresh
    assert wait_until(lambda: refreshed(worker_set) and not decode_worker(worker_set).stale, 5.0)


def test_a_failed_connection_takes_the_worker_out_until_it_answers_again(router):
    worker_set, proxy, _ = router
    proxy.set_mode(RESET)
    worker_set.refresh()
    assert not decode_worker(worker_set).healthy
    proxy.set_mode(PASS)
    assert wait_until(lambda: refreshed(worker_set) and decode_worker(worker_set).healthy, 5.0)


def refreshed(worker_set) -> bool:
    worker_set.refresh()
    return True


def test_a_request_with_no_ready_pair_waits_for_one(router):
    worker_set, proxy, stub = router
    want = generate(stub)
    proxy.set_mode(RESET)
    worker_set.refresh()
    assert not decode_worker(worker_set).healthy
    result: list = []
    started = time.monotonic()
    waiter = threading.Thread(target=lambda: result.append(generate(stub)))
    waiter.start()
    time.sleep(0.7)  # the request is waiting for a decode worker now
    assert waiter.is_alive() and not result
    proxy.set_mode(PASS)  # the worker is back: the next poll lets the request through
    assert wait_until(lambda: refreshed(worker_set) and decode_worker(worker_set).healthy, 5.0)
    waiter.join(30)
    assert result == [want]
    assert 0.7 <= time.monotonic() - started < ROUTE_WAIT_S + 5


def test_the_wait_is_bounded_by_the_setting_and_the_deadline(router):
    worker_set, proxy, stub = router
    proxy.set_mode(RESET)
    worker_set.refresh()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub)
    waited = time.monotonic() - started
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert ROUTE_WAIT_S - 0.1 <= waited < ROUTE_WAIT_S + 2, waited
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, timeout=0.5)
    assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert time.monotonic() - started < 1.5
