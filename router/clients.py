"""The router's calls to its workers: Prefill (retried once elsewhere), Decode, ReleaseKv.

Ownership of the request's KV while the router holds the handle:

    Prefill (worker leases the blocks) ──► router holds the handle ──► Decode (imports, releases)
                                                 │
                              stop / cancel here ─► ReleaseKv (else the lease expires)

A Prefill call that ends without its answer (the router cancelled it, or the deadline passed)
may still have leased the blocks: the answer can be on its way when the call ends, and the
worker cannot know it was lost. The router then sends the prefill worker Abort for the request
id, which ends that lease (or the prompt, if still queued): docs/leases.md.

Every call carries what is left of the client's deadline (`TimeLeft`, asked at each call) and
the trace metadata, and is registered on the request's `ActiveRequest`: a client cancel or an
Abort cancels whichever call is in flight (the workers abort and free at once). Nothing here
sees the servicer's context. The calls are `grpc.aio` calls on the router's event loop: a
client that leaves cancels the request's task, which cancels the call it awaits; an Abort
cancels the call, which the awaiting task sees as `Aborted`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

from pagedserve.errors import Unavailable
from pagedserve.internal.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
)
from pagedserve.router.delivery import Delivered, DeliverStream
from pagedserve.router.routing import Decision, Worker, WorkerSet
from pagedserve.v1 import common_pb2

log = logging.getLogger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
# A Prefill call ended so by our side may have been answered with a lease we never saw
UNANSWERED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)

TimeLeft = Callable[[], float | None]  # seconds left of the client's deadline (None: none)
Metadata = Sequence[tuple[str, str]]


class Aborted(Exception):
    """The client aborted (Abort RPC or cancel) while a worker call was in flight."""


class WorkerLost(Unavailable):
    """The decode worker of a running stream is gone (connection failed) or stalled: the
    stream may move to another pair."""


class WorkerError(Exception):
    """A worker answered with a status we pass on as is."""

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        super().__init__(err)
        self.err = err

    @property
    def code(self) -> grpc.StatusCode:
        return self.err.code()

    @property
    def details(self) -> str:
        return self.err.details() or ""

    def field_violation(self) -> tuple[str, str] | None:
        """(field, description) of the worker's INVALID_ARGUMENT, when its status names one."""
        if self.code is not grpc.StatusCode.INVALID_ARGUMENT:
            return None
        for key, value in self.err.trailing_metadata() or ():
            if key != "grpc-status-details-bin":
                continue
            for detail in status_pb2.Status.FromString(value).details:
                bad_request = error_details_pb2.BadRequest()
                if detail.Unpack(bad_request) and bad_request.field_violations:
                    violation = bad_request.field_violations[0]
                    return violation.field, violation.description
        return None


@dataclass(slots=True)
class ActiveRequest:
    """A request in flight: what to cancel when the client leaves or Abort arrives.

    `handle` is the lease the router holds: set when Prefill returns one, cleared when the
    decode worker answers (it releases the lease from then on); still set at the end, the
    router releases it (`WorkerClients.release_unclaimed`). Touched only on the event loop."""

    cancel_current: Callable[[], object] | None = None
    aborted: bool = False
    handle: tuple[Worker, str] | None = None  # (prefill worker, handle id) not yet passed on
    unanswered: tuple[Worker, str] | None = None  # (prefill worker, request id): answer lost

    def set_call(self, cancel: Callable[[], object] | None) -> None:
        self.cancel_current = cancel
        if self.aborted and cancel is not None:
            cancel()

    def abort(self) -> None:
        self.aborted = True
        if self.cancel_current is not None:
            self.cancel_current()


def _decode_request(
    request: worker_pb2.WorkerRequest, prefilled: prefill_pb2.PrefillResponse | None
) -> decode_pb2.DecodeRequest:
    """What the decode worker is sent: `prefilled`'s first token(s) and lease, or (None)
    the request alone, to prefill there."""
    if prefilled is None:
        return decode_pb2.DecodeRequest(request=request, prefill_here=True)
    return decode_pb2.DecodeRequest(
        request=request,
        first_token=prefilled.first_token,
        first_logprobs=prefilled.logprobs if prefilled.HasField("logprobs") else None,
        kv_handle=prefilled.kv_handle,
        samples=prefilled.samples,
    )


def _client_left() -> bool:
    """True when this task itself is being cancelled (the client left), as opposed to a worker
    call we cancelled (an Abort)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class WorkerClients:
    """Worker RPCs of every request; counts the calls it makes and the workers' in-flight."""

    def __init__(
        self,
        workers: WorkerSet,
        prefill_retries: int,
        stall_timeout_s: float = 10.0,
        delivery: bool = True,
    ) -> None:
        self.workers = workers
        self.prefill_retries = prefill_retries
        self.stall_timeout_s = stall_timeout_s
        self.delivery = delivery  # Decode responses on a Deliver stream per worker
        self.requests_to_workers = 0
        self._deliver: dict[str, DeliverStream] = {}  # by decode worker id
        self._tasks: set[asyncio.Task] = set()  # fire-and-forget calls, kept until done

    def background(self, coro: Awaitable[None]) -> None:
        """Run `coro` without waiting for it (a best-effort worker call); the task is kept
        referenced until it ends (the event loop holds only a weak reference)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """End the Deliver streams (the router stops)."""
        streams, self._deliver = list(self._deliver.values()), {}
        for stream in streams:
            await stream.close()

    async def prefill(
        self,
        request: worker_pb2.WorkerRequest,
        route: Callable[[list[str]], Awaitable[Decision]],
        active: ActiveRequest,
        time_left: TimeLeft,
        metadata: Metadata,
    ) -> tuple[prefill_pb2.PrefillResponse, Decision]:
        """Prefill on the pair `route(tried workers)` picks; a retryable failure before any
        token retries on another pair. On return `active.handle` holds the lease (if any).
        Raises Aborted, WorkerError, or what `route` raises."""
        tried: list[str] = []
        for attempt in range(1 + self.prefill_retries):
            decision = await route(tried)
            stub = prefill_pb2_grpc.PrefillWorkerStub(decision.prefill.channel)
            call = stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request=request, decode_worker_id=decision.decode.worker_id
                ),
                timeout=time_left(),
                metadata=metadata,
            )
            active.set_call(call.cancel)
            num_tokens = len(request.prompt_token_ids)
            decision.prefill.in_flight += 1
            decision.prefill.in_flight_tokens += num_tokens
            self.requests_to_workers += 1
            try:
                result = await call
                if result.HasField("kv_handle"):
                    active.handle = (decision.prefill, result.kv_handle.handle_id)
                return result, decision
            except asyncio.CancelledError:
                active.unanswered = (decision.prefill, request.request_id)
                if _client_left():
                    raise
                if active.aborted:
                    raise Aborted from None
                # NOTE: cancelled by neither side (its channel closed): the worker is gone
                if attempt >= self.prefill_retries:
                    raise Unavailable("prefill call cancelled") from None
                self.workers.mark_failed(decision.prefill)
                tried.append(decision.prefill.worker_id)
            except grpc.aio.AioRpcError as err:
                if err.code() in UNANSWERED:
                    active.unanswered = (decision.prefill, request.request_id)
                self._raise_unless_retryable(err, active, attempt)
                self.workers.mark_failed(decision.prefill)
                tried.append(decision.prefill.worker_id)
            finally:
                decision.prefill.in_flight -= 1
                decision.prefill.in_flight_tokens -= num_tokens
                active.set_call(None)
        raise AssertionError("unreachable")

    def _raise_unless_retryable(
        self, err: grpc.aio.AioRpcError, active: ActiveRequest, attempt: int
    ) -> None:
        code = err.code()
        if active.aborted or code is grpc.StatusCode.CANCELLED:
            raise Aborted from None
        if code not in RETRYABLE or attempt >= self.prefill_retries:
            raise WorkerError(err) from None

    async def decode(
        self,
        request: worker_pb2.WorkerRequest,
        prefilled: prefill_pb2.PrefillResponse | None,
        decision: Decision,
        active: ActiveRequest,
        time_left: TimeLeft,
        metadata: Metadata,
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        """The decode worker's stream (`prefilled` None: the worker computes the prompt and
        its first token itself). Closing it before the worker's last message cancels the
        call (the worker frees at once). Raises Aborted, WorkerLost (the worker's connection
        failed, or it sent nothing for `stall_timeout_s` while failing its load polls: marked
        failed) or WorkerError."""
        message = _decode_request(request, prefilled)
        source = await self._decode_call(message, decision.decode, time_left, metadata)
        active.set_call(source.cancel)
        decision.decode.in_flight += 1
        self.requests_to_workers += 1
        finished = False
        try:
            async with aclosing(self._watched(source, decision.decode)) as parts:
                async for part in parts:
                    # NOTE: a response proves the decode worker took the request, and with it
                    # the lease (it releases it). Until then the router still releases it
                    # itself: a cancel can end the call before the worker's handler ever runs.
                    # ReleaseKv is idempotent, and a worker whose lease goes mid-pull
                    # recomputes (fails closed).
                    active.handle = None
                    finished = bool(part.finish_reason)
                    yield part
        except asyncio.CancelledError:
            if _client_left():
                raise
            if active.aborted:
                raise Aborted from None
            # NOTE: cancelled by neither side (its channel closed): as a lost worker
            self.workers.mark_failed(decision.decode)
            raise WorkerLost("decode call cancelled mid-stream") from None
        except grpc.aio.AioRpcError as err:
            if active.aborted or err.code() is grpc.StatusCode.CANCELLED:
                raise Aborted from None
            if err.code() is grpc.StatusCode.UNAVAILABLE:
                self.workers.mark_failed(decision.decode)
                raise WorkerLost("decode worker lost mid-stream") from None
            raise WorkerError(err) from None
        finally:
            if not finished:
                source.cancel()  # NOTE: e.g. a stop string matched; the worker frees at once
            if isinstance(source, Delivered):
                source.close()
            decision.decode.in_flight -= 1
            active.set_call(None)

    async def _decode_call(
        self,
        message: decode_pb2.DecodeRequest,
        worker: Worker,
        time_left: TimeLeft,
        metadata: Metadata,
    ) -> Delivered | grpc.aio.UnaryStreamCall:
        """The Decode call, its responses on the worker's Deliver stream when it has one."""
        deliver = self._deliver_stream(worker) if self.delivery else None
        message.delivery_id = (await deliver.delivery_id() if deliver else None) or ""
        call = decode_pb2_grpc.DecodeWorkerStub(worker.channel).Decode(
            message, timeout=time_left(), metadata=metadata
        )
        if deliver is None or not message.delivery_id:
            return call
        return Delivered(deliver, message.request.request_id, call)

    def _deliver_stream(self, worker: Worker) -> DeliverStream:
        """The Deliver stream on `worker`'s channel (a new one for a new channel)."""
        assert worker.channel is not None
        stream = self._deliver.get(worker.worker_id)
        if stream is None or stream.channel is not worker.channel:
            if stream is not None:
                self.background(stream.close())
            stream = self._deliver[worker.worker_id] = DeliverStream(
                worker.channel, worker.worker_id
            )
        return stream

    async def _watched(
        self, call: Delivered | grpc.aio.UnaryStreamCall, worker: Worker
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        """The call's messages; WorkerLost when none came for `stall_timeout_s` and the worker
        does not answer its load polls either (a worker that answers may just queue the
        request: slow is not dead).

        One timer per call, re-armed when it fires, watches the wait: nothing per message (an
        `asyncio.wait` with a timeout around each read cost the router more than the read)."""
        loop = asyncio.get_running_loop()
        reader: asyncio.Task | None = None  # the task awaiting the worker's message, if any
        waiting_since = 0.0
        stalled = False
        timer: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal timer, stalled
            idle = 0.0 if reader is None else loop.time() - waiting_since
            if (
                reader is not None
                and idle >= self.stall_timeout_s
                and (worker.stale or not worker.healthy)
            ):
                stalled = True
                reader.cancel()  # NOTE: cancels the read, and with it the call
                return
            left = self.stall_timeout_s - idle
            timer = loop.call_later(left if left > 0 else self.stall_timeout_s, check)

        timer = loop.call_later(self.stall_timeout_s, check)
        try:
            while True:
                reader, waiting_since = asyncio.current_task(), loop.time()
                try:
                    part = await call.read()
                except asyncio.CancelledError:
                    # NOTE: a client that left as well keeps its cancel
                    if stalled and reader is not None and reader.uncancel() == 0:
                        self.workers.mark_failed(worker)
                        raise WorkerLost("decode worker stalled") from None
                    raise
                reader = None
                if part is grpc.aio.EOF:
                    return
                yield part
        finally:
            if timer is not None:
                timer.cancel()

    async def abort_sample(self, worker: Worker, request_id: str, index: int) -> None:
        """Stop sample `index` of a multi-sample request on its decode worker (its stop string
        matched here); best effort: a failure only costs the worker that sample's tokens."""
        try:
            stub = decode_pb2_grpc.DecodeWorkerStub(worker.channel)
            sample_id = f"{request_id}#{index}"
            await stub.Abort(common_pb2.AbortRequest(request_id=sample_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            log.warning(
                "%s: could not stop sample %d on %s", request_id, index, worker.worker_id,
                extra={"request_id": request_id},
            )  # fmt: skip

    async def release_unclaimed(self, active: ActiveRequest) -> None:
        """End the lease no decode worker took: ReleaseKv by its handle, or Abort by the request
        id when the Prefill answer carrying the handle was lost (both idempotent; a failure
        leaves the lease to expire)."""
        if active.handle is not None:
            worker, handle_id = active.handle
            try:
                stub = prefill_pb2_grpc.PrefillWorkerStub(worker.channel)
                await stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(handle_id=handle_id), timeout=2.0)
            except grpc.aio.AioRpcError:
                log.warning("could not release lease %s; it will expire", handle_id)
            active.handle = None
        if active.unanswered is not None:
            worker, request_id = active.unanswered
            try:
                stub = prefill_pb2_grpc.PrefillWorkerStub(worker.channel)
                await stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=2.0)
            except grpc.aio.AioRpcError:
                log.warning(
                    "%s: could not abort on %s; a lease expires", request_id, worker.worker_id
                )
            active.unanswered = None
