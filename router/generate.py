"""One Generate request across the cluster: route -> Prefill -> first token -> Decode -> stream.

    admit ─► hash the prompt's blocks ─► route (router.route span) ─► Prefill ──► first token
                                              ▲ retry once elsewhere ┘                │
                                                                          Decode ◄────┘
    release the lease no worker took, record the outcome ◄─ stop / cancel / error / finish

A prefill that fails before any token retries once on another worker. A decode worker lost
mid-stream (connection failed, or no message for `--stall-timeout` while it also fails its load
polls) does not end the stream: the router re-prefills the prompt plus the tokens already sent
on a live pair and continues the same client stream (`router.migrate` span event), at most
`--max-migrations` times; greedy output equals an undisturbed run. Worker calls live in
`clients.py`, the client's messages in `stream.py`, the record of the end in `outcome.py`.

Request ids are scoped by tenant (router/auth.py): the in-flight table is keyed by
`(tenant, request_id)`, so two tenants may run the same id, and neither Abort nor an "already
running" answer reveals another tenant's ids. Workers see `auth.worker_request_id(tenant, id)`;
clients only ever see their own id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Span

from pagedserve import telemetry
from pagedserve.errors import AlreadyExists, ResourceExhausted, Unavailable
from pagedserve.internal.v1 import prefill_pb2, worker_pb2
from pagedserve.kvstore.hashing import BlockHash, hash_blocks
from pagedserve.metrics import RequestMetrics
from pagedserve.router import convert
from pagedserve.router.auth import worker_request_id
from pagedserve.router.clients import (
    Aborted,
    ActiveRequest,
    Metadata,
    TimeLeft,
    WorkerClients,
    WorkerError,
    WorkerLost,
)
from pagedserve.router.outcome import Outcome, reason_name, record
from pagedserve.router.routing import Decision, RoutingPolicy, WorkerSet
from pagedserve.router.stream import ClientStream, SampleStreams, merge, merge_samples
from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.v1 import common_pb2, generation_pb2

log = logging.getLogger(__name__)
ROUTE_POLL_S = 0.05  # how often a request waiting for a ready pair looks again


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The orchestrator's settings; the flag-backed ones are built by `RouterOptions.settings`
    (router/server.py), their defaults are the parser's."""

    block_size: int
    model_fingerprint: bytes
    max_queued_requests: int  # --max-queued-requests
    route_wait_s: float  # how long a request waits for a ready pair (within its deadline)
    stream_interval: int  # --stream-interval: a request's default
    max_n: int  # --max-n: most samples per request
    stall_timeout_s: float  # no message and no load poll answered: the worker is lost
    max_migrations: int  # moves of one stream to another pair when its decode worker is lost
    decode_delivery: bool  # a Deliver stream per decode worker (router/delivery.py)
    prefill_retries: int = 1
    move_wait_s: float = 30.0  # how long a retry or a moved stream waits for a ready pair


@dataclass(frozen=True, slots=True)
class _Call:
    """What every stage of one request's run passes on: its entry in `active`, its deadline,
    and the trace context its worker calls carry."""

    active: ActiveRequest
    time_left: TimeLeft
    parent: Context
    metadata: Metadata

    @classmethod
    def of(cls, span: Span, active: ActiveRequest, time_left: TimeLeft) -> _Call:
        parent = telemetry.span_context(span)
        return cls(active, time_left, parent, telemetry.metadata(parent))


class Orchestrator:
    """Runs Generate requests and owns the table of those in flight (`active`)."""

    def __init__(
        self,
        tokenizer: RouterTokenizer,
        workers: WorkerSet,
        policy: RoutingPolicy,
        settings: RouterSettings,
        tracing: telemetry.Tracing,
        metrics: RequestMetrics,
    ) -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.settings = settings
        self.tracing = tracing
        self.metrics = metrics
        self.clients = WorkerClients(
            workers, settings.prefill_retries, settings.stall_timeout_s, settings.decode_delivery
        )
        self.active: dict[tuple[str, str], ActiveRequest] = {}  # (tenant, request_id) -> it
        self.arriving = 0  # requests let in by `check_room`, not yet admitted (tokenizing)
        self.last_decision: Decision | None = None  # for tests and debugging

    def check_room(self, *, arriving: bool = False) -> None:
        """ResourceExhausted (with a retry delay) while `max_queued_requests` are in flight or
        arriving; `arriving`: the caller is one of `arriving` itself."""
        if len(self.active) + self.arriving - arriving >= self.settings.max_queued_requests:
            raise ResourceExhausted("router queue is full", retry_after_s=1.0)

    def admit(self, tenant: str, request_id: str, *, arriving: bool = False) -> ActiveRequest:
        """Register `(tenant, request_id)`; a duplicate is the same tenant's own mistake.
        The caller then runs `generate`, which removes it again. `arriving`: the caller
        counted it in `arriving` (it still must uncount it)."""
        self.check_room(arriving=arriving)
        key = (tenant, request_id)
        if key in self.active:
            raise AlreadyExists(f"request_id: {request_id!r} is already running")
        active = self.active[key] = ActiveRequest()
        return active

    def abort(self, tenant: str, request_id: str) -> bool:
        """Abort the tenant's own request; False when it has none of that id in flight."""
        active = self.active.get((tenant, request_id))
        if active is not None:
            active.abort()
        return active is not None

    async def generate(
        self,
        req: convert.RouterRequest,
        tenant: str,
        active: ActiveRequest,
        *,
        trace_parent: Context,
        attributes: dict,
        time_left: TimeLeft,
        started: float,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """The client's messages (one merged message unless `req.stream`). Raises WorkerError
        (a status to pass on) or `pagedserve.errors`; at the end, whatever happened (the client
        leaving cancels this task), removes the request from `active`, releases a lease no
        worker took and records the outcome."""
        span = self.tracing.tracer.start_span(
            "router.generate", context=trace_parent, attributes=attributes
        )
        outcome = Outcome(on_tokens=self.metrics.phases.tokens_arrived)
        try:
            several = req.params.num_samples > 1 or req.params.use_beam_search
            run_fn = self._run_samples if several else self._run
            async with aclosing(run_fn(req, tenant, active, span, outcome, time_left)) as run:
                if req.stream:
                    async for out in run:
                        yield out
                elif several:
                    for out in merge_samples([out async for out in run]):
                        yield out
                else:
                    yield merge([out async for out in run])
        except asyncio.CancelledError:
            active.aborted = True  # NOTE: the client left
            raise
        except Aborted:
            outcome.reason = "abort"
            yield generation_pb2.GenerateResponse(
                request_id=req.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
            )
        except WorkerError:
            outcome.reason = "error"
            raise
        finally:
            # NOTE: shielded: a client that leaves must not cut the lease release short
            await asyncio.shield(self._end(req, tenant, active, span, outcome, started))

    async def _end(
        self,
        req: convert.RouterRequest,
        tenant: str,
        active: ActiveRequest,
        span: Span,
        outcome: Outcome,
        started: float,
    ) -> None:
        # NOTE: before the id is free again: an Abort by id must not reach a new request
        await self.clients.release_unclaimed(active)
        self.active.pop((tenant, req.request_id), None)
        e2e_s = time.monotonic() - started
        record(self.metrics, span, req, tenant, outcome, active.aborted, e2e_s)

    async def _run(
        self,
        req: convert.RouterRequest,
        tenant: str,
        active: ActiveRequest,
        span: Span,
        outcome: Outcome,
        time_left: TimeLeft,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Prefill, first token, decode; a decode worker lost mid-stream (or stalled) moves the
        rest of the stream to another pair (`_migrate`), at most `max_migrations` times."""
        call = _Call.of(span, active, time_left)
        stream: ClientStream | None = None
        current = req
        for attempt in range(1 + self.settings.max_migrations):
            # NOTE: a suffix per move: the old worker may hold the id until our cancel lands
            worker_id = worker_request_id(tenant, req.request_id) + (
                f"~{attempt}" if attempt else ""
            )
            request = convert.worker_request(current, worker_id)
            prefilled, decision = await self._place(
                current, request, call, moved=attempt > 0, decode_may_prefill=True
            )
            if prefilled is not None:
                outcome.first_token()
                stream = stream or ClientStream(req, self.tokenizer, prefilled.cached_tokens)
                first = stream.from_prefill(prefilled)
                outcome.count(stream.completion_tokens, stream.cached_tokens)
                if stream.finished:
                    outcome.reason = reason_name(first.finish_reason)
                    yield stream.finish(first)
                    return
                yield first
            stream = stream or ClientStream(req, self.tokenizer, 0)
            decode = self._decode(request, prefilled, decision, stream, call)
            try:
                async with aclosing(decode):
                    async for out in decode:
                        outcome.first_token()  # NOTE: prefilled here: the first message
                        outcome.count(stream.completion_tokens, stream.cached_tokens)
                        if out.finish_reason:
                            outcome.reason = reason_name(out.finish_reason)
                        yield out
                return
            except WorkerLost as lost:
                if attempt >= self.settings.max_migrations:
                    raise Unavailable(f"{lost}; no moves left") from None
                current = await self._migrate(req, stream, active, span, decision, str(lost))

    async def _place(
        self,
        req: convert.RouterRequest,
        request: worker_pb2.WorkerRequest,
        call: _Call,
        *,
        moved: bool,
        decode_may_prefill: bool,
    ) -> tuple[prefill_pb2.PrefillResponse | None, Decision]:
        """Route `req` (its prompt's block hashes) to a pair and prefill it there; a prefill
        retry goes where a new route sends it. Prefill None: the decode worker prefills the
        prompt itself, which only `decode_may_prefill` (on the first route) allows. `moved`:
        a migrated stream, whose routes wait as long as retries do."""
        hashes = hash_blocks(
            req.prompt_token_ids,
            self.settings.block_size,
            model_fingerprint=self.settings.model_fingerprint,
            cache_salt=req.cache_salt,
        )
        num_tokens = len(req.prompt_token_ids) if decode_may_prefill else None
        decision = await self._route(hashes, [], call, retry=moved, num_tokens=num_tokens)
        self.last_decision = decision
        if decision.prefill_here:
            return None, decision

        async def first_then_route(tried: list[str]) -> Decision:
            if not tried:
                return decision
            return await self._route(hashes, tried, call, retry=True)

        prefilled, decision = await self.clients.prefill(
            request, first_then_route, call.active, call.time_left, call.metadata
        )
        self.last_decision = decision
        return prefilled, decision

    async def _run_samples(
        self,
        req: convert.RouterRequest,
        tenant: str,
        active: ActiveRequest,
        span: Span,
        outcome: Outcome,
        time_left: TimeLeft,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """`_run` for a request with several samples: one prefill draws every sample's first
        token, one decode worker forks the prompt's blocks into a sequence per sample.

        NOTE: a lost decode worker ends the request with UNAVAILABLE: the samples are not
        moved (a move would re-prefill each sample's own continuation)."""
        call = _Call.of(span, active, time_left)
        request = convert.worker_request(req, worker_request_id(tenant, req.request_id))
        prefilled, decision = await self._place(
            req, request, call, moved=False, decode_may_prefill=False
        )
        if prefilled is None:  # NOTE: the decode worker prefills only a single-sample prompt
            raise RuntimeError("router: a request with several samples was routed to prefill here")
        outcome.first_token()
        streams = SampleStreams(req, self.tokenizer, prefilled.cached_tokens)
        for out in streams.from_prefill(prefilled):
            yield out
        outcome.count(streams.completion_tokens, streams.cached_tokens)
        if not req.params.use_beam_search and (
            streams.finished or prefilled.HasField("finish_reason")
        ):
            outcome.reason = "stop" if streams.finished else reason_name(prefilled.finish_reason)
            return
        parts = self.clients.decode(request, prefilled, decision, active, time_left, call.metadata)
        stopped: set[int] = set()
        try:
            async with aclosing(parts):
                async for part in parts:
                    for out in streams.from_decode(part):
                        yield out
                    self._stop_samples(streams, stopped, decision, request.request_id)
                    outcome.count(streams.completion_tokens, streams.cached_tokens)
                    if streams.finished:
                        outcome.reason = reason_name(part.finish_reason or 1)
                        return
        except Aborted:
            for out in streams.abort():
                yield out
            return
        except WorkerLost as lost:
            raise Unavailable(f"{lost}; a request with several samples is not moved") from None
        raise WorkerLost("decode stream ended before every sample finished")

    def _stop_samples(
        self, streams: SampleStreams, stopped: set[int], decision: Decision, worker_id: str
    ) -> None:
        """Samples whose stop string matched here: the decode worker stops making them."""
        for index in set(streams.stopped_here()) - stopped:
            stopped.add(index)
            self.clients.background(self.clients.abort_sample(decision.decode, worker_id, index))

    async def _migrate(
        self,
        req: convert.RouterRequest,
        stream: ClientStream,
        active: ActiveRequest,
        span: Span,
        decision: Decision,
        reason: str,
    ) -> convert.RouterRequest:
        """The request that continues `stream` elsewhere; ends what the lost pair held."""
        span.add_event(
            "router.migrate",
            {
                "pagedserve.decode_worker": decision.decode.worker_id,
                "pagedserve.reason": reason,
                "pagedserve.tokens_sent": len(stream.token_ids),
            },
        )
        log.warning(
            "%s: %s on %s after %d tokens; moving the stream",
            req.request_id, reason, decision.decode.worker_id, len(stream.token_ids),
        )  # fmt: skip
        await self.clients.release_unclaimed(active)  # NOTE: a lease no decode worker took
        return convert.continuation(req, list(stream.token_ids))

    async def _route(
        self,
        hashes: Sequence[BlockHash],
        exclude: list[str],
        call: _Call,
        *,
        retry: bool = False,
        num_tokens: int | None = None,
    ) -> Decision:
        """The pair for a request; a retry or a moved stream (`retry`) waits longer for one
        (`move_wait_s`: a supervisor restarting the only worker of a role), a new request
        `route_wait_s`. `num_tokens` (the prompt's length): the decode worker may prefill it
        (`RoutingPolicy.choose`)."""
        wait_s = self.settings.move_wait_s if retry else self.settings.route_wait_s
        with self.tracing.tracer.start_span("router.route", context=call.parent) as route:
            decision = await self._choose_or_wait(
                hashes, exclude, call.active, call.time_left, wait_s, num_tokens
            )
            route.set_attributes({f"pagedserve.route.{k}": v for k, v in decision.terms.items()})
            route.set_attribute("pagedserve.prefill_worker", decision.prefill.worker_id)
            route.set_attribute("pagedserve.decode_worker", decision.decode.worker_id)
            route.set_attribute("pagedserve.cached_blocks", decision.cached_blocks)
        return decision

    async def _choose_or_wait(
        self,
        hashes: Sequence[BlockHash],
        exclude: list[str],
        active: ActiveRequest,
        time_left: TimeLeft,
        wait_s: float,
        num_tokens: int | None = None,
    ) -> Decision:
        """The cheapest ready pair. With none (a worker restarting, every worker busy failing
        over), wait for one, polling every ROUTE_POLL_S, at most `wait_s` and never past the
        request's deadline; then Unavailable. Aborted if the client leaves meanwhile."""
        left = time_left()
        give_up = time.monotonic() + (wait_s if left is None else min(wait_s, left))
        while True:
            try:
                choose = functools.partial(
                    self.policy.choose, hashes, exclude, num_tokens=num_tokens
                )
                if self.policy.blocks:  # NOTE: a Redis lookup: off the event loop
                    return await asyncio.to_thread(choose)
                return choose()
            except LookupError as exc:
                if active.aborted:
                    raise Aborted() from None
                if time.monotonic() + ROUTE_POLL_S > give_up:
                    raise Unavailable(str(exc)) from None
            await asyncio.sleep(ROUTE_POLL_S)

    async def _decode(
        self,
        request: worker_pb2.WorkerRequest,
        prefilled: prefill_pb2.PrefillResponse | None,
        decision: Decision,
        stream: ClientStream,
        call: _Call,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        parts = self.clients.decode(
            request, prefilled, decision, call.active, call.time_left, call.metadata
        )
        async with aclosing(parts):
            try:
                async for part in parts:
                    out = stream.from_decode(part)
                    if stream.finished:
                        await parts.aclose()  # NOTE: cancels the call unless the worker ended it
                        yield stream.finish(out)
                        return
                    if out.token_ids or out.text:
                        yield out
            except Aborted:
                yield stream.abort()
                return
        raise WorkerLost("decode stream ended without a finish reason")
