"""`Deliver` streams: a step's DecodeResponses for many requests in one message.

    engine loop ── publish (one call_soon_threadsafe a step) ──► DeliveredStream.put (per delta)
        ──► Delivery.pending ──► the Deliver handler: one DecodeBatch per wake-up
    Decode call (delivery_id set) ── awaits `DeliveredStream.ended` ──► its status

A Decode call streams one message per request and step, and a gRPC message costs each end of a
connection about 90 us of CPU on a 2-vCPU EPYC (`pagedserve bench grpc-messages`): with 48
requests that is most of the per-token cost of the hop to the router. A router opens one Deliver
stream per worker and names it in every DecodeRequest; the worker then adds each request's
responses to that stream's pending batch, and the Deliver handler sends what is pending each
time it wakes (once per step, or once for several steps when it lags).

The Decode call keeps the request's life: cancelling it aborts the request, its deadline holds,
an error ends it with a status. It sends no message, and ends only once the request's last
response has been sent on the Deliver stream, so a router never sees the call end before the
response that ends the request (both travel on one connection, in that order).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pagedserve.decode_worker import convert
from pagedserve.decode_worker.streams import AsyncRequestStream, Delta
from pagedserve.errors import AlreadyExists, InvalidArgument, Unavailable
from pagedserve.internal.v1 import decode_pb2
from pagedserve.model.requests.sequence import FinishReason

MAX_ID_CHARS = 128
MAX_BATCH_BYTES = 1 << 20  # NOTE: far below a router's --max-message-bytes (64 MiB)


class Delivery:
    """One Deliver stream's pending responses (touched on the server's event loop only)."""

    def __init__(self) -> None:
        self._pending: list[decode_pb2.DecodeResponse] = []
        self._after_send: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._closed = False
        self._streams: set[DeliveredStream] = set()

    def add(self, response: decode_pb2.DecodeResponse, then: Callable[[], None] | None) -> None:
        """Send `response` with the next batch; `then()` once that batch is sent."""
        self._pending.append(response)
        if then is not None:
            self._after_send.append(then)
        self._wake.set()

    async def batches(
        self,
    ) -> AsyncIterator[tuple[list[decode_pb2.DecodeBatch], list[Callable[[], None]]]]:
        """Each wake-up's batches (one, unless its responses pass `MAX_BATCH_BYTES`) and the
        callbacks to run once they are sent, until `close`."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._pending:
                batches = _split(self._pending)
                callbacks, self._pending, self._after_send = self._after_send, [], []
                yield batches, callbacks
            if self._closed:
                return

    def close(self) -> None:
        """No more batches once the pending one is sent; the requests still open on it end
        with UNAVAILABLE (their Decode calls fail: the caller moves or fails them)."""
        self._closed = True
        self._wake.set()
        for stream in list(self._streams):
            stream.lost()


def _split(responses: list[decode_pb2.DecodeResponse]) -> list[decode_pb2.DecodeBatch]:
    """`responses` in order, in batches of at most MAX_BATCH_BYTES (a response larger than
    that alone: a router lagging many steps behind must not get one message it refuses)."""
    batches, size = [decode_pb2.DecodeBatch()], 0
    for response in responses:
        n = response.ByteSize()
        if size + n > MAX_BATCH_BYTES and batches[-1].responses:
            batches.append(decode_pb2.DecodeBatch())
            size = 0
        batches[-1].responses.append(response)
        size += n
    return batches


class Deliveries:
    """The Deliver streams open on one worker, by id."""

    def __init__(self) -> None:
        self._open: dict[str, Delivery] = {}

    def open(self, delivery_id: str) -> Delivery:
        if not delivery_id or len(delivery_id) > MAX_ID_CHARS:
            raise InvalidArgument("delivery_id", f"must be 1 to {MAX_ID_CHARS} characters")
        if delivery_id in self._open:
            raise AlreadyExists(f"delivery_id {delivery_id!r} is open")
        delivery = self._open[delivery_id] = Delivery()
        return delivery

    def end(self, delivery_id: str) -> None:
        delivery = self._open.pop(delivery_id, None)
        if delivery is not None:
            delivery.close()

    def end_all(self) -> None:
        for delivery_id in list(self._open):
            self.end(delivery_id)

    def stream(
        self,
        delivery_id: str,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        num_outputs: int,
    ) -> DeliveredStream:
        """The stream a delivered request's deltas go to. Unavailable when no Deliver stream
        of that id is open (it ended: the caller's connection went, or this worker stops)."""
        delivery = self._open.get(delivery_id)
        if delivery is None:
            raise Unavailable(f"no Deliver stream {delivery_id!r} is open on this worker")
        return DeliveredStream(loop, delivery, request_id, num_outputs)


class DeliveredStream(AsyncRequestStream):
    """A request's deltas as responses on a Deliver stream (`publish` hands them over on the
    loop like any `AsyncRequestStream`'s; nothing reads them here). `ended` resolves once the
    request's last response was sent: to None, or to the error message of a request that
    ended with ERROR; to Unavailable when the Deliver stream ended first."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        delivery: Delivery,
        request_id: str,
        num_outputs: int,
    ) -> None:
        super().__init__(loop)
        self.delivery = delivery
        self.request_id = request_id
        self.ended: asyncio.Future[str | None] = loop.create_future()
        self._left = num_outputs  # outputs (samples, beams) whose last response is to come
        self._error: str | None = None
        delivery._streams.add(self)

    def put(self, delta: Delta) -> None:
        if self.ended.done():
            return  # NOTE: the request ended (or its stream did): nobody wants the rest
        then = None
        if delta.finish_reason is not None:
            self._left -= 1
            if delta.finish_reason is FinishReason.ERROR:
                self._error = delta.error or "decode failed"
            if self._left <= 0 or self._error is not None:
                then = self._sent_last
        self.delivery.add(convert.decode_response(self.request_id, delta), then)

    def _sent_last(self) -> None:
        self.delivery._streams.discard(self)
        if not self.ended.done():
            self.ended.set_result(self._error)

    def lost(self) -> None:
        self.delivery._streams.discard(self)
        if not self.ended.done():
            self.ended.set_exception(Unavailable("the Deliver stream of this request ended"))

    def close(self) -> None:
        """The Decode call ended (however it ended): nothing more is sent."""
        self.delivery._streams.discard(self)
        if not self.ended.done():
            self.ended.cancel()
