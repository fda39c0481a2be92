"""The router's end of `DecodeWorker.Deliver`: one stream per decode worker channel carries the
DecodeResponses of every Decode call the router makes there (decode_worker/delivery.py).

    Deliver stream ──► reader task ──► per request: an asyncio.Queue ──► `Delivered.read()`
    Decode call (delivery_id set) ── ends with an error ──► the same queue

`Delivered` reads like the Decode call it stands for (`read()` gives the responses, raises the
call's error), so `WorkerClients.decode` and its stall watch treat both alike. A Deliver stream
that ends (the worker went away or stops) ends every request on it with UNAVAILABLE: the
stream moves, as when a Decode call fails so. The next request opens a new one. A request does
not wait for a stream that takes longer than `OPEN_TIMEOUT_S` to open, nor use a worker's that
has no Deliver (UNIMPLEMENTED: older than this router; asked again after
`RETRY_UNSUPPORTED_S`): its Decode call then streams its own responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import grpc

from pagedserve.internal.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)

RETRY_UNSUPPORTED_S = 60.0
OPEN_TIMEOUT_S = 1.0  # a request waits this long for a stream to open, then streams itself
_OK = grpc.StatusCode.OK


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DeliverStream:
    """One Deliver stream on `channel`, opened on first use and again after it ends."""

    def __init__(self, channel: grpc.aio.Channel, name: str) -> None:
        self.channel = channel
        self.name = name  # the worker's id, for logs
        self.queues: dict[str, asyncio.Queue] = {}
        self._opened: asyncio.Future[str | None] | None = None
        self._task: asyncio.Task | None = None
        self._unsupported_at: float | None = None  # when the worker said it has no Deliver

    async def delivery_id(self) -> str | None:
        """The id of the open stream (opening it); None when the worker has none to offer."""
        at = self._unsupported_at
        if at is not None and time.monotonic() - at < RETRY_UNSUPPORTED_S:
            return None
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
            self._task = asyncio.get_running_loop().create_task(self._run(self._opened))
        if self._opened.done():
            return self._opened.result()  # NOTE: the common case: no wait, no task per request
        try:
            return await asyncio.wait_for(asyncio.shield(self._opened), OPEN_TIMEOUT_S)
        except TimeoutError:
            return None  # NOTE: a worker that does not answer: its Decode call is watched

    def register(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def unregister(self, request_id: str, queue: asyncio.Queue) -> None:
        if self.queues.get(request_id) is queue:
            del self.queues[request_id]

    async def _run(self, opened: asyncio.Future[str | None]) -> None:
        delivery_id = uuid.uuid4().hex
        stub = decode_pb2_grpc.DecodeWorkerStub(self.channel)
        call = stub.Deliver(decode_pb2.DeliverRequest(delivery_id=delivery_id))
        reason = "ended"
        try:
            first = await call.read()  # NOTE: the worker's first, empty batch: it is open
            if first is not grpc.aio.EOF:
                log.info("Deliver stream %s to %s open", delivery_id, self.name)
                opened.set_result(delivery_id)
                await self._hand_out(call)
        except grpc.aio.AioRpcError as err:
            reason = f"{err.code().name}: {err.details()}"
            if err.code() is grpc.StatusCode.UNIMPLEMENTED and not opened.done():
                log.info("%s has no Deliver: a stream per Decode call", self.name)
                self._unsupported_at = time.monotonic()
        except asyncio.CancelledError:
            reason = "closed"
            call.cancel()
            raise
        finally:
            self._ended(opened, reason)

    async def _hand_out(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Each batch's responses to their requests' queues, until the stream ends."""
        while (batch := await call.read()) is not grpc.aio.EOF:
            for response in batch.responses:
                queue = self.queues.get(response.request_id)
                if queue is not None:
                    queue.put_nowait(response)

    def _ended(self, opened: asyncio.Future[str | None], reason: str) -> None:
        """The stream is over: the next request opens another; those on it are lost."""
        if self._opened is opened:
            self._opened = None
        if not opened.done():
            opened.set_result(None)  # NOTE: not opened: those requests stream themselves
        lost = _error(grpc.StatusCode.UNAVAILABLE, f"Deliver stream {reason}")
        for queue in self.queues.values():
            queue.put_nowait(lost)
        self.queues.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Delivered:
    """A Decode call whose responses come on a `DeliverStream`: `read()` and `cancel()` as the
    call's (its error is raised by `read()` once the call ends with one)."""

    def __init__(
        self, stream: DeliverStream, request_id: str, call: grpc.aio.UnaryStreamCall
    ) -> None:
        self.stream = stream
        self.request_id = request_id
        self.call = call
        self.queue = stream.register(request_id)
        self._cancelled = False
        self._watch = asyncio.get_running_loop().create_task(self._status())

    async def _status(self) -> None:
        code = await self.call.code()
        if code is _OK:
            return  # NOTE: after the request's last response, which the stream brings
        if code is grpc.StatusCode.CANCELLED and not self._cancelled:
            # NOTE: cancelled by neither side: its channel closed, the worker is gone
            self.queue.put_nowait(_error(grpc.StatusCode.UNAVAILABLE, "decode call cancelled"))
            return
        self.queue.put_nowait(_error(code, await self.call.details()))

    async def read(self) -> decode_pb2.DecodeResponse:
        item = await self.queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def cancel(self) -> bool:
        self._cancelled = True
        return self.call.cancel()

    def close(self) -> None:
        self.stream.unregister(self.request_id, self.queue)
        self._watch.cancel()
