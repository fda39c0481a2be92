"""`pagedserve.internal.v1.DecodeWorker`: a thin asyncio servicer over `DecodeWorker`
(docs/decode.md).

No thread per stream: each Decode call is a coroutine awaiting its `AsyncRequestStream`, which
the engine loop fills once per step (once per `stream_interval` tokens). The worker's calls
that take its lock (`submit`, `abort`: at most one step's wait) run on a small executor, never
on the event loop, so health checks answer while a step computes; `GetLoad` never waits for
the lock (the load as of the last step when a step holds it), so it answers on the loop, not
queued behind submits on that executor.

Errors are raised, not aborted: the server's interceptor maps them (pagedserve/errors.py). When
the call ends however it ends (client cancel, deadline, disconnect), the request is aborted and
its blocks are freed at once (a no-op if it already finished).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from pagedserve.core_share import one_torch_thread
from pagedserve.decode_worker import convert
from pagedserve.decode_worker.delivery import Deliveries
from pagedserve.decode_worker.streams import AsyncRequestStream
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.internal.v1 import decode_pb2, decode_pb2_grpc
from pagedserve.model.requests.sequence import FinishReason
from pagedserve.protoconv import load_to_proto
from pagedserve.telemetry import context_from
from pagedserve.v1 import common_pb2
from pagedserve.worker_load import Role, test_load_delay_s

RPC_THREADS = 4  # the executor for calls that wait on the engine's lock


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.executor = ThreadPoolExecutor(
            RPC_THREADS, thread_name_prefix="decode-rpc", initializer=one_torch_thread
        )
        self.load_delay_s = test_load_delay_s()
        self.deliveries = Deliveries()

    async def Decode(self, request, context) -> AsyncIterator[decode_pb2.DecodeResponse]:  # noqa: N802
        call = convert.decode_call(request)
        loop = asyncio.get_running_loop()
        parent = context_from(context.invocation_metadata())
        if request.delivery_id:
            await self._decode_delivered(call, request.delivery_id, parent, context)
            return
        stream = AsyncRequestStream(loop)
        submitted = self.executor.submit(self.worker.submit, call, parent, stream)
        finished = False
        # NOTE: the worker holds a delta back until its stream_interval is full; the first
        # token goes alone, at once (TTFT): a prefill worker sends it when there is one, else
        # it is this worker's first delta, never merged with a late reader's next
        first_here = call.prefill_here
        try:
            await asyncio.wrap_future(submitted)
            ended = 0
            while not finished:
                delta = await stream.get(merge=not first_here)
                first_here = False
                yield convert.decode_response(call.request_id, delta)
                if delta.finish_reason is FinishReason.ERROR:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, delta.error or "decode failed"
                    )
                ended += delta.finish_reason is not None
                finished = ended == call.num_outputs
        finally:
            if not finished:
                # NOTE: the client left (or the deadline passed): once submit has returned
                # (it may still be running on the executor), abort frees the blocks
                submitted.add_done_callback(
                    lambda f: self._abort_submitted(f, call.request_id, stream)
                )

    async def _decode_delivered(self, call, delivery_id: str, parent, context) -> None:
        """`Decode` whose responses go on the Deliver stream `delivery_id` (delivery.py): wait
        for the request's end, then end the call the same way."""
        loop = asyncio.get_running_loop()
        stream = self.deliveries.stream(delivery_id, loop, call.request_id, call.num_outputs)
        submitted = self.executor.submit(self.worker.submit, call, parent, stream)
        finished = False
        try:
            await asyncio.wrap_future(submitted)
            error = await stream.ended
            finished = True
            if error is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, error)
        finally:
            stream.close()
            if not finished:
                submitted.add_done_callback(
                    lambda f: self._abort_submitted(f, call.request_id, stream)
                )

    async def Deliver(self, request, context) -> AsyncIterator[decode_pb2.DecodeBatch]:  # noqa: N802
        delivery = self.deliveries.open(request.delivery_id)
        try:
            yield decode_pb2.DecodeBatch()  # NOTE: open: Decode calls may name it from now on
            async for batches, callbacks in delivery.batches():
                for batch in batches:
                    yield batch
                for sent in callbacks:
                    sent()
        finally:
            self.deliveries.end(request.delivery_id)

    def end_deliveries(self) -> None:
        """End every Deliver stream (the worker stops): requests still on one fail over."""
        self.deliveries.end_all()

    def _abort_submitted(self, submitted: Future, request_id: str, stream) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            self.executor.submit(self.worker.abort, request_id, stream)

    async def Abort(self, request, context) -> common_pb2.AbortResponse:  # noqa: N802
        found = await self._off_loop(self.worker.abort, request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.LoadReport:  # noqa: N802
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        load = self.worker.load(max_wait_s=0.0)  # NOTE: never blocks the loop
        return load_to_proto(load, self.worker.worker_id, Role.DECODE)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
