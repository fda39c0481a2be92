"""A Prefill answer lost on its way back: the router cancels its Prefill call after the prefill
worker has checked that its caller is still there, leased the blocks and answered. The worker
cannot tell the answer was lost; the router, which never saw the handle, must still end the lease
(by Abort on the request id), or the blocks stay pinned until the lease expires.

    client ─► router (in process) ─► prefill server (in process: real engine, real gRPC)
                                 └─► decode server (in process; never reached here)

The interleaving is forced, not timed: the prefill servicer is held right after its liveness
check (in `_record_spans`, just before it returns the answer) until the router has finished.
"""

from __future__ import annotations

import argparse
import threading

import grpc
import pytest
from oracle import make_prompts
from workers import wait_until

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.servicer import DecodeServicer
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.grpcutil import build_server
from pagedserve.prefill_worker.convert import Identity
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.lease_table import LeaseStats
from pagedserve.prefill_worker.server import build_grpc_server
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.prefill_worker.worker import PrefillWorker
from pagedserve.protoconv import sampling_to_proto
from pagedserve.router.server import build_servicer
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import decode_pb2_grpc, generation_pb2, generation_pb2_grpc

LONG = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BOUND_S = 30.0  # waits that end long before this (a bound, not a speed check)


@pytest.fixture
def cluster(tiny_llama):
    prefill = PrefillWorker(
        PrefillEngine.from_model_dir(
            str(tiny_llama), PrefillEngineConfig(block_size=16, num_blocks=64, use_shm=False)
        )
    )
    prefill_servicer = PrefillServicer(prefill, Identity("prefill-l", "inc-1", ""))
    prefill_server = build_grpc_server(prefill_servicer)
    prefill_servicer.me = Identity("prefill-l", "inc-1", f"127.0.0.1:{prefill_server.port}")
    decode = DecodeWorker(
        DecodeEngine.from_model_dir(str(tiny_llama), DecodeEngineConfig(block_size=16)),
        worker_id="decode-l",
    )
    decode_server = build_server(
        [lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(decode), s)],
        ["pagedserve.v1.DecodeWorker"],
    )
    args = argparse.Namespace(
        model=str(tiny_llama), served_model_name=None, revision="", dtype=None, block_size=16,
        redis_url=None, prefill=[f"127.0.0.1:{prefill_server.port}"],
        decode=[f"127.0.0.1:{decode_server.port}"], max_queued_requests=8,
        max_message_bytes=16 << 20,
    )  # fmt: skip
    router, worker_set = build_servicer(args)
    router_server = build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(router, s)],
        ["pagedserve.v1.Generation"],
    )
    prefill.start()
    decode.start()
    for handle in (prefill_server, decode_server, router_server):
        handle.server.start()
        handle.set_ready(True)
    worker_set.refresh()
    channel = grpc.insecure_channel(f"127.0.0.1:{router_server.port}")
    try:
        yield generation_pb2_grpc.GenerationStub(channel), router, prefill_servicer
    finally:
        channel.close()
        for handle in (router_server, decode_server, prefill_server):
            handle.server.stop(None).wait(5)
        worker_set.close()
        decode.close()
        prefill.close()


def hold_answers(servicer: PrefillServicer, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold every Prefill answer after the servicer's liveness check: `answering` is set when one
    is held, `go` lets it through."""
    answering, go = threading.Event(), threading.Event()
    record_spans = servicer._record_spans  # noqa: SLF001 - the seam right before the answer

    def held(result, parent) -> None:
        answering.set()
        assert go.wait(BOUND_S)
        record_spans(result, parent)

    monkeypatch.setattr(servicer, "_record_spans", held)
    return answering, go


def test_a_prefill_answer_lost_to_a_cancel_ends_its_lease_without_expiry(cluster, monkeypatch):
    stub, router, prefill_servicer = cluster
    worker = prefill_servicer.worker
    answering, go = hold_answers(prefill_servicer, monkeypatch)
    request = generation_pb2.GenerateRequest(
        request_id="lost", sampling=sampling_to_proto(LONG), stream=True
    )
    request.token_ids.ids.extend(make_prompts((40,), seed=41)[0])
    stream = stub.Generate(request, timeout=60)
    try:
        assert answering.wait(BOUND_S), "the prefill worker never answered"
        # the worker has checked its caller is there and leased the blocks; its answer is next
        assert worker.leases.stats() == LeaseStats(granted=1, released=0, expired=0, active=1)
        stream.cancel()  # the client leaves: the router cancels its Prefill call
        assert wait_until(lambda: router.num_active == 0, timeout_s=BOUND_S)
    finally:
        go.set()  # the answer now goes into a call that no longer exists
    assert wait_until(lambda: worker.leases.stats().active == 0, timeout_s=5), (
        "the lease outlived its request: only its expiry would end it"
    )
    assert worker.leases.stats() == LeaseStats(granted=1, released=1, expired=0, active=0)
    assert worker.engine.pool.num_used == 0
    worker.check_integrity()
