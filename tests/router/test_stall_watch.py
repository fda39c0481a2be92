"""The router's watch over a decode stream (`WorkerClients.decode`, `--stall-timeout`):

- silent for the stall timeout *and* failing its load polls: the worker is lost (WorkerLost,
  marked failed, the call cancelled, so the worker frees at once);
- silent for several stall timeouts but answering its polls: slow, not dead, the stream goes on;
- time the router's reader spends elsewhere (a slow client) is not the worker's silence;
- a client that leaves is a cancel, not a lost worker.

Against a real gRPC server on loopback playing a decode worker's stream on a script (the real
decode worker, stopped with SIGSTOP, is tests/faults/test_cluster_faults.py's).
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from support.aio_servers import serving

from pagedserve.grpcutil import build_server
from pagedserve.internal.v1 import decode_pb2, decode_pb2_grpc, worker_pb2
from pagedserve.router.clients import ActiveRequest, WorkerClients, WorkerLost
from pagedserve.router.routing import Decision, Worker, WorkerSet
from pagedserve.v1 import common_pb2
from pagedserve.worker_load import Role, WorkerLoad

STALL_S = 0.3


class ScriptedDecode(decode_pb2_grpc.DecodeWorkerServicer):
    """Sends one token after each pause of `script`; the last one ends the stream."""

    def __init__(self, script: list[float]) -> None:
        self.script = script
        self.cancelled = threading.Event()

    async def Decode(self, request, context):  # noqa: N802
        try:
            for i, pause in enumerate(self.script):
                await asyncio.sleep(pause)
                last = i == len(self.script) - 1
                yield decode_pb2.DecodeResponse(
                    request_id=request.request.request_id,
                    token_ids=[i],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                )
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def run(script: list[float], *, healthy: bool, reader_pause_s: float = 0.0, leave_after=None):
    """Read a scripted stream through `WorkerClients.decode`; what came, and how it ended."""
    servicer = ScriptedDecode(script)

    def register(server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)

    with serving(build_server([register], ["pagedserve.internal.v1.DecodeWorker"])) as handle:

        async def read() -> dict:
            workers = WorkerSet([], [], None, max_message_bytes=1 << 20)
            clients = WorkerClients(workers, prefill_retries=0, stall_timeout_s=STALL_S)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
            decode = Worker("decode-0", "", Role.DECODE, channel=channel)
            decode.load = WorkerLoad() if healthy else None
            decision = Decision(prefill=decode, decode=decode, cached_blocks=0)
            request = worker_pb2.WorkerRequest(request_id="r")
            got: dict = {"tokens": [], "outcome": "finished"}

            async def consume() -> None:
                parts = clients.decode(request, None, decision, ActiveRequest(), lambda: 30.0, ())
                async for part in parts:
                    got["tokens"] += list(part.token_ids)
                    await asyncio.sleep(reader_pause_s)

            task = asyncio.create_task(consume())
            try:
                if leave_after is not None:
                    await asyncio.sleep(leave_after)
                    task.cancel()
                await task
            except WorkerLost as err:
                got["outcome"] = str(err)
            except asyncio.CancelledError:
                got["outcome"] = "cancelled"
            got["failures"] = decode.failures
            await channel.close()
            return got

        got = asyncio.run(read())
        # NOTE: a cancel reaches the worker within milliseconds; a finished stream has none
        got["worker_saw_cancel"] = servicer.cancelled.wait(
            2.0 if got["outcome"] != "finished" else 0.1
        )
        return got


def test_a_silent_worker_failing_its_polls_is_lost_and_its_call_cancelled():
    got = run([0.0, 0.0, 30.0], healthy=False)
    assert got["tokens"] == [0, 1]
    assert got["outcome"] == "decode worker stalled"
    assert got["failures"] == 1
    assert got["worker_saw_cancel"]


def test_a_silent_worker_answering_its_polls_is_slow_not_dead():
    got = run([0.0, 3 * STALL_S, 0.0], healthy=True)
    assert got["tokens"] == [0, 1, 2]
    assert got == {**got, "outcome": "finished", "failures": 0, "worker_saw_cancel": False}


def test_time_the_reader_spends_elsewhere_is_not_the_workers_silence():
    # NOTE: the worker sends everything at once; the router's reader takes 2 stall timeouts
    # over each message (a slow client) while the worker fails its polls
    got = run([0.0, 0.0, 0.0], healthy=False, reader_pause_s=2 * STALL_S)
    assert got["tokens"] == [0, 1, 2]
    assert got == {**got, "outcome": "finished", "failures": 0}


@pytest.mark.parametrize("healthy", [True, False])
def test_a_client_that_leaves_is_a_cancel_not_a_lost_worker(healthy):
    got = run([0.0, 30.0], healthy=healthy, leave_after=STALL_S / 3)
    assert got["tokens"] == [0]
    assert got == {**got, "outcome": "cancelled", "failures": 0, "worker_saw_cancel": True}
