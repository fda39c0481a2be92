"""`pagedserve.v1.Generation`: validate, route, Prefill -> first token -> Decode -> stream.

Ownership of the request's KV while the router holds the handle:

    Prefill (worker leases the blocks) ──► router holds the handle ──► Decode (imports, releases)
                                                 │
                              stop / cancel here ─► ReleaseKv (else the lease expires)

A Prefill call that ends without its answer (the router cancelled it, or the deadline passed)
may still have leased the blocks: the answer can be on its way when the call ends, and the
worker cannot know it was lost. The router then sends the prefill worker Abort for the request
id, which ends that lease (or the prompt, if still queued).

A client cancel or deadline cancels whichever worker call is in flight (the workers abort and
free at once). A prefill that fails before any token retries once on another worker; a decode
worker lost mid-stream ends the stream with UNAVAILABLE.

Request ids are scoped by tenant (router/auth.py): the in-flight table is keyed by
`(tenant, request_id)`, so two tenants may run the same id, and neither Abort nor an "already
running" answer reveals another tenant's ids. Workers see `auth.worker_request_id(tenant, id)`;
clients only ever see their own id.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from pagedserve import telemetry
from pagedserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pagedserve.grpcutil import time_remaining
from pagedserve.kvstore.hashing import hash_blocks
from pagedserve.metrics import RequestMetrics
from pagedserve.router import convert
from pagedserve.router.auth import current_tenant, tenant_salt, worker_request_id
from pagedserve.router.detokenizer import Detokenizer
from pagedserve.router.routing import Decision, RoutingPolicy, Worker, WorkerSet
from pagedserve.router.tokenizer import ModelCard, RouterTokenizer
from pagedserve.sampling_params import MAX_LOGPROBS
from pagedserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

log = logging.getLogger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
# A Prefill call ended so by our side may have been answered with a lease we never saw
UNANSWERED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    block_size: int
    model_fingerprint: bytes
    max_queued_requests: int = 256
    prefill_retries: int = 1


@dataclass(slots=True)
class _Active:
    """A request in flight: what to cancel when the client leaves or Abort arrives."""

    cancel_current: Callable[[], None] | None = None
    aborted: bool = False
    handle: tuple[Worker, str] | None = None  # (prefill worker, handle id) not yet passed on
    unanswered: tuple[Worker, str] | None = None  # (prefill worker, request id): answer lost
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set_call(self, cancel: Callable[[], None] | None) -> None:
        with self.lock:
            self.cancel_current = cancel
            aborted = self.aborted
        if aborted and cancel is not None:
            cancel()

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            cancel = self.cancel_current
        if cancel is not None:
            cancel()


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        tokenizer: RouterTokenizer,
        card: ModelCard,
        workers: WorkerSet,
        policy: RoutingPolicy,
        settings: RouterSettings,
        *,
        tracing: telemetry.Tracing | None = None,
        metrics: RequestMetrics | None = None,
    ) -> None:
        self.tracing = tracing or telemetry.setup_tracing("pagedserve-router", None)
        self.metrics = metrics or RequestMetrics(CollectorRegistry())
        self.tokenizer = tokenizer
        self.card = card
        self.workers = workers
        self.policy = policy
        self.settings = settings
        self._active: dict[tuple[str, str], _Active] = {}  # (tenant, request_id) -> request
        self._lock = threading.Lock()
        self.requests_to_workers = 0
        self.last_decision: Decision | None = None  # for tests and debugging

    @property
    def num_active(self) -> int:
        return len(self._active)

    # ---- Generate -------------------------------------------------------------------------

    def Generate(self, request, context) -> Iterator[generation_pb2.GenerateResponse]:  # noqa: N802
        started = time.monotonic()
        try:
            req = convert.router_request(request, self.tokenizer, self.card)
            tenant = current_tenant()
            req = dataclasses.replace(req, cache_salt=tenant_salt(tenant, req.cache_salt))
            key = (tenant, req.request_id)
            active = self._admit(key)
        except InvalidArgument:
            self.metrics.rejected.labels(reason="invalid_argument").inc()
            raise
        except ResourceExhausted:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise
        context.add_callback(active.abort)
        span = self.tracing.tracer.start_span(
            "router.generate",
            context=telemetry.context_from(context.invocation_metadata()),
            attributes=_request_attributes(req, self.tracing.include_text, request),
        )
        outcome = _Outcome()
        try:
            responses = self._generate(req, tenant, active, context, span, outcome)
            if req.stream:
                yield from responses
            else:
                yield _merge(list(responses))
        except _Aborted:
            outcome.reason = "abort"
            yield generation_pb2.GenerateResponse(
                request_id=req.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
            )
        except _WorkerError as exc:
            outcome.reason = "error"
            context.abort(exc.err.code(), exc.err.details())  # type: ignore[attr-defined]
        finally:
            # NOTE: before the id is free again: an Abort by id must not reach a new request
            self._release_unclaimed(active)
            with self._lock:
                self._active.pop(key, None)
            self._record(req, tenant, outcome, active, span, time.monotonic() - started)

    def _record(
        self, req, tenant: str, outcome: _Outcome, active: _Active, span, e2e_s: float
    ) -> None:
        reason = outcome.reason or ("abort" if active.aborted else "error")
        if reason == "abort":
            self.metrics.aborted.labels(cause="client").inc()
        self.metrics.finished(
            reason=reason,
            prompt=len(req.prompt_token_ids),
            generated=outcome.generated,
            ttft_s=outcome.ttft_s,
            e2e_s=e2e_s,
        )
        span.set_attribute("gen_ai.usage.prompt_tokens", len(req.prompt_token_ids))
        span.set_attribute("gen_ai.usage.completion_tokens", outcome.generated)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        if outcome.ttft_s is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", outcome.ttft_s)
        span.set_attribute("gen_ai.latency.e2e", e2e_s)
        trace_id = span.get_span_context().trace_id
        span.end()
        # NOTE: one structured line per request outcome; never the prompt or output text
        log.info(
            "request_finished %s",
            json.dumps(
                {
                    "request_id": req.request_id,
                    "tenant": tenant or None,  # workers log `tenant:request_id`
                    "trace_id": f"{trace_id:032x}" if trace_id else None,
                    "finish_reason": reason,
                    "prompt_tokens": len(req.prompt_token_ids),
                    "completion_tokens": outcome.generated,
                    "ttft_s": round(outcome.ttft_s, 4) if outcome.ttft_s is not None else None,
                    "e2e_s": round(e2e_s, 4),
                }
            ),
        )

    def _admit(self, key: tuple[str, str]) -> _Active:
        """Register `(tenant, request_id)`; a duplicate is the same tenant's own mistake."""
        with self._lock:
            if len(self._active) >= self.settings.max_queued_requests:
                raise ResourceExhausted("router queue is full", retry_after_s=1.0)
            if key in self._active:
                raise convert.InvalidArgument("request_id", f"{key[1]!r} is already running")
            active = self._active[key] = _Active()
        return active

    def _generate(
        self,
        req: convert.RouterRequest,
        tenant: str,
        active: _Active,
        context: grpc.ServicerContext,
        span: Span,
        outcome: _Outcome,
    ) -> Iterator[generation_pb2.GenerateResponse]:
        hashes = hash_blocks(
            req.prompt_token_ids,
            self.settings.block_size,
            model_fingerprint=self.settings.model_fingerprint,
            cache_salt=req.cache_salt,
        )
        parent = telemetry.span_context(span)
        metadata = telemetry.metadata(parent)
        worker_request = convert.worker_request(req, worker_request_id(tenant, req.request_id))
        prefilled, decision = self._prefill(
            worker_request, hashes, active, context, metadata, parent
        )
        outcome.ttft_s = time.monotonic() - outcome.started
        outcome.generated = 1
        stream = _Stream(req, self.tokenizer, prefilled.cached_tokens)
        if prefilled.HasField("kv_handle"):
            active.handle = (decision.prefill, prefilled.kv_handle.handle_id)
        first_token = prefilled.first_token
        first = stream.add(
            [first_token],
            [prefilled.logprobs],
            prefilled.finish_reason,
            first_token if first_token in req.params.stop_token_ids else None,
        )
        if stream.finished:
            outcome.reason = _reason(first.finish_reason)
            yield stream.finish(first)
            return
        yield first
        for out in self._decode(
            worker_request, prefilled, decision, stream, active, context, metadata
        ):
            outcome.generated = stream.completion_tokens
            if out.finish_reason:
                outcome.reason = _reason(out.finish_reason)
            yield out

    def _prefill(self, worker_request, hashes, active, context, metadata, parent):
        tried: list[str] = []
        for attempt in range(1 + self.settings.prefill_retries):
            with self.tracing.tracer.start_span("router.route", context=parent) as route:
                decision = self._choose(hashes, tried)
                route.set_attributes(decision.terms)
                route.set_attribute("pagedserve.prefill_worker", decision.prefill.worker_id)
                route.set_attribute("pagedserve.decode_worker", decision.decode.worker_id)
                route.set_attribute("pagedserve.cached_blocks", decision.cached_blocks)
            stub = prefill_pb2_grpc.PrefillWorkerStub(decision.prefill.channel)
            call = stub.Prefill.future(
                prefill_pb2.PrefillRequest(
                    request=worker_request, decode_worker_id=decision.decode.worker_id
                ),
                timeout=time_remaining(context),
                metadata=metadata,
            )
            active.set_call(call.cancel)
            decision.prefill.in_flight += 1
            self.requests_to_workers += 1
            try:
                result = call.result()
                self.last_decision = decision
                return result, decision
            except grpc.FutureCancelledError:
                active.unanswered = (decision.prefill, worker_request.request_id)
                raise _Aborted from None
            except grpc.RpcError as err:
                if err.code() in UNANSWERED:  # type: ignore[attr-defined]
                    active.unanswered = (decision.prefill, worker_request.request_id)
                self._raise_unless_retryable(err, active, attempt)
                self.workers.mark_failed(decision.prefill)
                tried.append(decision.prefill.worker_id)
            finally:
                decision.prefill.in_flight -= 1
                active.set_call(None)
        raise AssertionError("unreachable")

    def _raise_unless_retryable(self, err: grpc.RpcError, active: _Active, attempt: int) -> None:
        code = err.code()  # type: ignore[attr-defined]
        if active.aborted or code is grpc.StatusCode.CANCELLED:
            raise _Aborted from None
        if code not in RETRYABLE or attempt >= self.settings.prefill_retries:
            raise _WorkerError(err) from None

    def _choose(self, hashes, exclude) -> Decision:
        try:
            return self.policy.choose(hashes, exclude)
        except LookupError as exc:
            raise Unavailable(str(exc)) from None

    def _decode(self, worker_request, prefilled, decision, stream, active, context, metadata):
        stub = decode_pb2_grpc.DecodeWorkerStub(decision.decode.channel)
        call = stub.Decode(
            decode_pb2.DecodeRequest(
                request=worker_request,
                first_token=prefilled.first_token,
                first_logprobs=prefilled.logprobs if prefilled.HasField("logprobs") else None,
                kv_handle=prefilled.kv_handle,
            ),
            timeout=time_remaining(context),
            metadata=metadata,
        )
        active.set_call(call.cancel)
        decision.decode.in_flight += 1
        self.requests_to_workers += 1
        try:
            for part in call:
                # NOTE: a response proves the decode worker took the request, and with it the
                # lease (it releases it). Until then the router still releases it itself: a
                # cancel can end the call before the worker's handler ever runs. ReleaseKv is
                # idempotent, and a worker whose lease goes mid-pull recomputes (fails closed).
                active.handle = None
                stop_id = (
                    part.matched_stop_token_id if part.HasField("matched_stop_token_id") else None
                )
                out = stream.add(
                    list(part.token_ids), list(part.logprobs), part.finish_reason, stop_id
                )
                if stream.finished:
                    if not part.finish_reason:
                        call.cancel()  # NOTE: a stop string matched; the worker frees at once
                    yield stream.finish(out)
                    return
                if out.token_ids or out.text:
                    yield out
        except grpc.RpcError as err:
            if active.aborted or err.code() is grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                yield stream.finish(stream.empty(), common_pb2.FINISH_REASON_ABORT)
                return
            if err.code() is grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                self.workers.mark_failed(decision.decode)
                raise Unavailable("decode worker lost mid-stream") from None
            raise _WorkerError(err) from None
        finally:
            decision.decode.in_flight -= 1
            active.set_call(None)
        raise Unavailable("decode stream ended without a finish reason")

    def _release_unclaimed(self, active: _Active) -> None:
        """End the lease no decode worker took: by its handle, or by the request id when the
        Prefill answer carrying the handle was lost (best effort: else the lease expires)."""
        if active.handle is not None:
            worker, handle_id = active.handle
            try:
                stub = prefill_pb2_grpc.PrefillWorkerStub(worker.channel)
                stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(handle_id=handle_id), timeout=2.0)
            except grpc.RpcError:
                log.warning("could not release lease %s; it will expire", handle_id)
        if active.unanswered is not None:
            worker, request_id = active.unanswered
            try:
                stub = prefill_pb2_grpc.PrefillWorkerStub(worker.channel)
                stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=2.0)
            except grpc.RpcError:
                log.warning(
                    "%s: could not abort on %s; a lease expires", request_id, worker.worker_id
                )

    # ---- the rest -------------------------------------------------------------------------

    def Abort(self, request, context) -> common_pb2.AbortResponse:  # noqa: N802
        with self._lock:
            # NOTE: only the caller's own tenant is looked at: another tenant's id is unknown
            active = self._active.get((current_tenant(), request.request_id))
        if active is not None:
            active.abort()
        return common_pb2.AbortResponse(found=active is not None)

    def Tokenize(self, request, context) -> generation_pb2.TokenizeResponse:  # noqa: N802
        if len(request.text) > convert.MAX_PROMPT_CHARS:
            raise convert.InvalidArgument("text", "too long")
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = self.tokenizer.encode(request.text, add_special_tokens=add)
        return generation_pb2.TokenizeResponse(token_ids=ids)

    def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:  # noqa: N802
        card = self.card
        return generation_pb2.ModelInfo(
            model_name=card.name,
            max_model_len=card.max_model_len,
            vocab_size=card.vocab_size,
            block_size=self.settings.block_size,
            eos_token_ids=card.eos_token_ids,
            dtype=card.dtype,
            architecture=card.architecture,
            max_logprobs=MAX_LOGPROBS,
        )

    def GetClusterStatus(self, request, context) -> generation_pb2.ClusterStatus:  # noqa: N802
        self.workers.refresh()
        status = generation_pb2.ClusterStatus(index_degraded=self.policy.index_degraded)
        computed = cached = 0.0
        for w in self.workers.workers():
            role = common_pb2.WORKER_ROLE_PREFILL if w.role.value == "prefill" else None
            status.workers.add(
                worker_id=w.worker_id,
                role=role or common_pb2.WORKER_ROLE_DECODE,
                address=w.address,
                incarnation=w.incarnation,
                alive=w.healthy,
                load=w.load,
            )
            if w.load is not None and role is not None:
                cached += w.load.prefix_cache_hit_rate
                computed += 1
        status.prefix_cache_hit_rate = cached / computed if computed else 0.0
        return status


@dataclass(slots=True)
class _Outcome:
    """What the metrics and the span record when a request ends."""

    started: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    generated: int = 0
    reason: str | None = None


def _reason(finish_reason: int) -> str:
    name = common_pb2.FinishReason.Name(finish_reason)  # type: ignore[arg-type]
    return name.removeprefix("FINISH_REASON_").lower()


def _request_attributes(req, include_text: bool, request) -> dict:
    attributes = {
        "gen_ai.request.id": req.request_id,
        "gen_ai.request.max_tokens": req.params.max_tokens,
        "gen_ai.request.temperature": req.params.temperature,
        "pagedserve.priority": req.priority,
    }
    if include_text and request.WhichOneof("prompt") == "text":
        attributes["gen_ai.prompt"] = request.text
    return attributes


class _Aborted(Exception):
    """The client aborted (Abort RPC or cancel) while a worker call was in flight."""


class _WorkerError(Exception):
    """A worker answered with a status we pass on as is."""

    def __init__(self, err: grpc.RpcError) -> None:
        super().__init__(err)
        self.err = err


@dataclass(slots=True)
class _Stream:
    """Builds GenerateResponses: token deltas, text deltas, cumulative usage, stops."""

    req: convert.RouterRequest
    tokenizer: RouterTokenizer
    cached_tokens: int
    completion_tokens: int = 0
    finished: bool = False
    stop_token: int | None = None
    detok: Detokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.detok = Detokenizer(
            self.tokenizer, skip_special_tokens=self.req.params.skip_special_tokens,
            stop=self.req.params.stop,
        )  # fmt: skip

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_tokens,
        )

    def empty(self) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=self.req.request_id, usage=self.usage())

    def add(
        self,
        token_ids: list[int],
        logprobs: list[common_pb2.Logprobs],
        finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED,
        stop_token_id: int | None = None,
    ) -> generation_pb2.GenerateResponse:
        """One worker delta in; the client's delta out (finish fields set when it ends)."""
        self.completion_tokens += len(token_ids)
        out = generation_pb2.GenerateResponse(
            request_id=self.req.request_id,
            token_ids=token_ids,
            text=self.detok.add(token_ids),
            logprobs=[lp for lp in logprobs if lp.ByteSize()],
            usage=self.usage(),
        )
        if self.detok.matched_stop is not None:
            self.finished = True
            out.finish_reason = common_pb2.FINISH_REASON_STOP
            out.stop_string = self.detok.matched_stop
        elif finish_reason:
            self.finished = True
            out.finish_reason = finish_reason  # type: ignore[assignment]
            if stop_token_id is not None:
                out.stop_token_id = stop_token_id
        return out

    def finish(
        self, out: generation_pb2.GenerateResponse, reason: int | None = None
    ) -> generation_pb2.GenerateResponse:
        self.finished = True
        out.text += self.detok.flush()
        if reason is not None:
            out.finish_reason = reason  # type: ignore[assignment]
        out.usage.CopyFrom(self.usage())
        return out


def _merge(parts: list[generation_pb2.GenerateResponse]) -> generation_pb2.GenerateResponse:
    """Non-streaming requests get one message: the concatenation of the stream."""
    merged = generation_pb2.GenerateResponse()
    for part in parts:
        merged.request_id = part.request_id
        merged.token_ids.extend(part.token_ids)
        merged.text += part.text
        merged.logprobs.extend(part.logprobs)
        merged.usage.CopyFrom(part.usage)
        merged.finish_reason = part.finish_reason
        which = part.WhichOneof("matched_stop")
        if which:
            setattr(merged, which, getattr(part, which))
    return merged
