"""A Prefill answer lost on its way back: the router cancels its Prefill call after the prefill
worker has checked that its caller is still there, leased the blocks and answered. The worker
cannot tell the answer was lost; the router, which never saw the handle, must still end the lease
(by Abort on the request id), or the blocks stay pinned until the lease expires.

    client ─► router (in process) ─► prefill server (in process: real engine, real gRPC)
                                 └─► decode server (in process; never reached here)

The interleaving is forced, not timed: the prefill servicer is held just before it returns the
answer (in `_record_spans`) until the router has seen its call end unanswered.
"""

from __future__ import annotations

import argparse
import threading
from contextlib import ExitStack

import pytest
from support.aio_servers import serving
from support.in_process_router import serve_router
from support.oracle import make_prompts
from support.waits import wait_until

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.servicer import DecodeServicer
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.grpcutil import build_server
from pagedserve.internal.v1 import decode_pb2_grpc
from pagedserve.prefill_worker.convert import Identity
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.lease_table import LeaseStats
from pagedserve.prefill_worker.server import build_grpc_server
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.prefill_worker.worker import PrefillWorker
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2

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
    decode = DecodeWorker(
        DecodeEngine.from_model_dir(str(tiny_llama), DecodeEngineConfig(block_size=16)),
        worker_id="decode-l",
    )
    decode_servicer = DecodeServicer(decode)
    prefill.start()
    decode.start()
    with ExitStack() as stack:
        prefill_server = stack.enter_context(serving(build_grpc_server(prefill_servicer)))
        prefill_servicer.me = Identity("prefill-l", "inc-1", f"127.0.0.1:{prefill_server.port}")
        decode_server = stack.enter_context(serving(build_server(
            [lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(decode_servicer, s)],
            ["pagedserve.internal.v1.DecodeWorker"],
        )))  # fmt: skip
        args = argparse.Namespace(
            model=str(tiny_llama), served_model_name=None, revision="", dtype=None,
            block_size=16, redis_url=None, prefill=[f"127.0.0.1:{prefill_server.port}"],
            decode=[f"127.0.0.1:{decode_server.port}"], max_queued_requests=8,
            max_message_bytes=16 << 20,
        )  # fmt: skip
        router = stack.enter_context(serve_router(args))
        stack.callback(prefill.close)
        stack.callback(decode.close)
        stack.callback(decode_servicer.close)
        yield router.stub, router.servicer, prefill_servicer


def unanswered(router) -> bool:
    """The router has seen its Prefill call end without the answer."""
    return any(a.unanswered is not None for a in list(router.orchestrator.active.values()))


def hold_answers(servicer: PrefillServicer, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold every Prefill answer right before the servicer returns it (its lease granted):
    `answering` is set when one is held, `go` lets it through. The hold blocks the prefill
    server's event loop, as a slow answer on the wire would: nothing there sees the cancel."""
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
        assert wait_until(lambda: unanswered(router), timeout_s=BOUND_S)
    finally:
        go.set()  # the answer now goes into a call that no longer exists
    # NOTE: the router's Abort by request id reaches the worker once its loop runs again
    assert wait_until(lambda: router.num_active == 0, timeout_s=BOUND_S)
    assert wait_until(lambda: worker.leases.stats().active == 0, timeout_s=5), (
        "the lease outlived its request: only its expiry would end it"
    )
    assert worker.leases.stats() == LeaseStats(granted=1, released=1, expired=0, active=0)
    assert worker.engine.pool.num_used == 0
    worker.check_integrity()
