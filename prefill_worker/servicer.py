"""`pagedserve.internal.v1.PrefillWorker`: a thin asyncio servicer over `PrefillWorker`
(docs/prefill.md).

Every queued prompt is in the worker's scheduler (priority order), none in a gRPC thread queue:
a Prefill call is a coroutine awaiting the worker's future. The worker's lock is never held
across a forward, so its calls run on the event loop.

Errors are raised, not aborted: the server's interceptor maps them (pagedserve/errors.py), except
a prompt whose step failed (`PrefillFailed`): INTERNAL with the request id in the message. A
client that cancels a Prefill (or whose deadline passes) aborts it; a lease granted after the
client left is released at once, so no blocks stay pinned for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from pagedserve.errors import Unavailable
from pagedserve.grpcutil import time_remaining
from pagedserve.internal.v1 import prefill_pb2, prefill_pb2_grpc
from pagedserve.kvstore.transfer import iter_block_chunks
from pagedserve.metrics import PhaseMetrics
from pagedserve.prefill_worker import convert
from pagedserve.prefill_worker.lease_table import LeaseState
from pagedserve.prefill_worker.worker import PrefillFailed, PrefillWorker
from pagedserve.protoconv import load_to_proto
from pagedserve.telemetry import Tracing, context_from, setup_tracing
from pagedserve.v1 import common_pb2
from pagedserve.worker_load import Role, test_load_delay_s

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
TRACE_KEYS = ("traceparent", "tracestate")


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self, worker: PrefillWorker, me: convert.Identity, tracing: Tracing | None = None
    ) -> None:
        self.tracing = tracing or setup_tracing("pagedserve-prefill", None)
        self.worker = worker
        self.me = me
        self.draining = False
        self.load_delay_s = test_load_delay_s()
        self.phases: PhaseMetrics | None = None  # the server's histograms (none in tests)

    async def Prefill(self, request, context):  # noqa: N802 - gRPC method name
        if self.draining:
            raise Unavailable("prefill worker is draining")
        call = convert.prefill_call(request)
        future = self.worker.submit(
            call.request_id,
            call.prompt_token_ids,
            call.params,
            priority=call.priority,
            cache_salt=call.cache_salt,
            lease_seconds=call.lease_seconds,
        )
        try:
            # NOTE: wait() neither raises when the worker cancels the future (an Abort) nor
            # cancels it on a timeout; a client that leaves cancels this task instead
            done, _ = await asyncio.wait(
                [asyncio.wrap_future(future)], timeout=time_remaining(context)
            )
        except asyncio.CancelledError:
            # NOTE: the client left: the prompt is dropped, or the lease granted meanwhile ends
            # (nobody will pull; a client that leaves after the answer calls Abort itself)
            self.worker.abort(call.request_id)
            raise
        if not done:
            self.worker.abort(call.request_id)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        if future.cancelled():
            await context.abort(grpc.StatusCode.CANCELLED, "prefill aborted")
        try:
            result = future.result()
        except PrefillFailed as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        trace = {k: v for k, v in context.invocation_metadata() if k in TRACE_KEYS}
        self._record_spans(result, context_from(trace))
        self._observe(result)
        return convert.prefill_response(result, self.worker.engine, self.me, trace)

    def _observe(self, result) -> None:
        """The request's queue and prefill times and its prompt length, in the histograms."""
        if self.phases is None or not result.started_ns:
            return
        self.phases.queue.observe((result.started_ns - result.enqueued_ns) / 1e9)
        self.phases.prefill.observe((result.finished_ns - result.started_ns) / 1e9)
        self.phases.prompt_tokens.observe(result.seq.num_prompt_tokens)

    def _record_spans(self, result, parent) -> None:
        """prefill.queue and prefill.compute, from the times the worker recorded."""
        if not self.tracing.enabled or not result.started_ns:
            return
        seq = result.seq
        attributes = {
            "pagedserve.request_id": seq.request_id,
            "pagedserve.worker_id": self.me.worker_id,
        }
        tracer = self.tracing.tracer
        queue = tracer.start_span(
            "prefill.queue", context=parent, attributes=attributes, start_time=result.enqueued_ns
        )
        queue.end(end_time=result.started_ns)
        compute = tracer.start_span(
            "prefill.compute", context=parent, attributes=attributes, start_time=result.started_ns
        )
        compute.set_attribute("pagedserve.prompt_tokens", seq.num_prompt_tokens)
        compute.set_attribute("pagedserve.cached_tokens", seq.num_cached_prompt_tokens)
        compute.set_attribute(
            "pagedserve.computed_tokens", seq.num_prompt_tokens - seq.num_cached_prompt_tokens
        )
        compute.end(end_time=result.finished_ns)

    async def PullKv(self, request, context) -> AsyncIterator[prefill_pb2.KvChunk]:  # noqa: N802
        if request.producer_incarnation != self.me.incarnation:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "handle of another incarnation"
            )
        block_ids = self.worker.leased_blocks(request.handle_id)
        if block_ids is None:
            await self._abort_dead_lease(request.handle_id, context)
            return
        caches = self.worker.engine.runner.kv_caches or []
        if request.rank >= len(caches):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank: {request.rank} is not a rank whose KV this worker can read "
                f"(0..{len(caches) - 1})",
            )
        max_chunk = min(request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        chunks = iter_block_chunks(
            caches[request.rank], block_ids, max_chunk, list(request.block_indices)
        )
        for chunk in chunks:
            yield convert.kv_chunk(chunk)
        if self.worker.leased_blocks(request.handle_id) is None:
            # NOTE: the lease ended while we streamed: the bytes may be from a reused block
            await self._abort_dead_lease(request.handle_id, context, " during the transfer")

    async def _abort_dead_lease(self, handle_id: str, context, when: str = "") -> None:
        """FAILED_PRECONDITION for an expired lease, NOT_FOUND for an unknown or released one."""
        if self.worker.lease_state(handle_id) is LeaseState.EXPIRED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"lease expired{when}")
        await context.abort(grpc.StatusCode.NOT_FOUND, f"lease unknown or released{when}")

    async def Abort(self, request, context) -> common_pb2.AbortResponse:  # noqa: N802
        return common_pb2.AbortResponse(found=self.worker.abort(request.request_id))

    async def ReleaseKv(self, request, context):  # noqa: N802
        return prefill_pb2.ReleaseKvResponse(found=self.worker.release(request.handle_id))

    async def RenewLease(self, request, context):  # noqa: N802
        expires = self.worker.renew(request.handle_id, float(request.extend_seconds))
        if expires is None:
            await self._abort_dead_lease(request.handle_id, context)
        return prefill_pb2.RenewLeaseResponse(lease_expires_unix_ms=expires)

    async def Warmup(self, request, context):  # noqa: N802
        if self.draining:
            raise Unavailable("prefill worker is draining")
        prompts = [list(p.ids) for p in request.prompts]
        try:
            blocks = await asyncio.to_thread(
                self.worker.warmup,
                prompts,
                cache_salt=request.cache_salt,
                timeout_s=time_remaining(context),
            )
        except FutureTimeout:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "warm-up did not finish in time")
        return prefill_pb2.WarmupResponse(blocks_cached=blocks)

    async def GetLoad(self, request, context) -> common_pb2.LoadReport:  # noqa: N802
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        draining = self.draining or self.worker.dead
        load = convert.worker_load(self.worker.engine, draining)
        return load_to_proto(load, self.me.worker_id, Role.PREFILL)
