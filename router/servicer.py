"""`pagedserve.v1.Generation`: the public API, translated and handed on.

Generate validates and converts the request (`convert.py`), scopes it to the caller's tenant
(`auth.py`), admits it and hands it to the `Orchestrator` (`generate.py`: route, Prefill,
Decode, lease release, the client's stream); a worker's status is passed on as the RPC's. The
other methods answer from the tokenizer (`tokenization.py`: Tokenize, Detokenize), the
model card and the worker set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from prometheus_client import CollectorRegistry

from pagedserve import telemetry
from pagedserve.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from pagedserve.grpcutil import time_remaining
from pagedserve.metrics import RequestMetrics, prefix_cache_hit_rate
from pagedserve.protoconv import load_to_proto
from pagedserve.router import convert, tokenization
from pagedserve.router.auth import current_tenant, tenant_salt
from pagedserve.router.clients import ActiveRequest, WorkerError
from pagedserve.router.generate import Orchestrator, RouterSettings
from pagedserve.router.outcome import rejected, request_attributes
from pagedserve.router.routing import Decision, RoutingPolicy, WorkerSet
from pagedserve.router.tokenizer import ModelCard, RouterTokenizer
from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

__all__ = ["GenerationServicer", "RouterSettings"]

STATUS_POLL_S = 0.25  # how long GetClusterStatus waits for a worker's load


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
        self.orchestrator = Orchestrator(
            tokenizer, workers, policy, settings, self.tracing, self.metrics
        )

    @property
    def num_active(self) -> int:
        return len(self.orchestrator.active)

    @property
    def requests_to_workers(self) -> int:
        return self.orchestrator.clients.requests_to_workers

    @property
    def last_decision(self) -> Decision | None:
        return self.orchestrator.last_decision

    async def Generate(  # noqa: N802
        self, request, context
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        started = time.monotonic()
        try:
            req, tenant, active = await self._admit(request)
        except (InvalidArgument, ResourceExhausted, AlreadyExists) as exc:
            reason = {InvalidArgument: "invalid_argument", ResourceExhausted: "queue_full"}
            if type(exc) in reason:
                self.metrics.rejected.labels(reason=reason[type(exc)]).inc()
            parent = telemetry.context_from(context.invocation_metadata())
            rejected(self.tracing.tracer, request, parent, self.card.name, exc)
            raise
        responses = self.orchestrator.generate(
            req,
            tenant,
            active,
            trace_parent=telemetry.context_from(context.invocation_metadata()),
            attributes=request_attributes(req, self.tracing.include_text, request, self.card.name),
            time_left=lambda: time_remaining(context),
            started=started,
        )
        try:
            async with aclosing(responses):
                async for response in responses:
                    yield response
        except WorkerError as exc:
            violation = exc.field_violation()
            if violation is not None:  # NOTE: e.g. a grammar only the workers can compile
                raise InvalidArgument(request_field(violation[0]), violation[1]) from None
            await context.abort(exc.code, exc.details)

    async def _admit(
        self, request: generation_pb2.GenerateRequest
    ) -> tuple[convert.RouterRequest, str, ActiveRequest]:
        """Validate, tokenize and admit. NOTE: a request counts against the limit from the
        moment it arrives: a burst beyond it is refused before it is tokenized (no tokenizer
        time), and nothing waits uncounted in the tokenizer's queue."""
        self.orchestrator.check_room()
        self.orchestrator.arriving += 1
        try:
            # NOTE: tokenizing (and rendering a chat) is CPU work: off the event loop
            req = await asyncio.to_thread(
                convert.router_request,
                request,
                self.tokenizer,
                self.card,
                self.settings.stream_interval,
                self.settings.max_n,
            )
            tenant = current_tenant()
            req = dataclasses.replace(req, cache_salt=tenant_salt(tenant, req.cache_salt))
            return req, tenant, self.orchestrator.admit(tenant, req.request_id, arriving=True)
        finally:
            self.orchestrator.arriving -= 1

    # ---- the rest -------------------------------------------------------------------------

    async def Abort(self, request, context) -> common_pb2.AbortResponse:  # noqa: N802
        # NOTE: only the caller's own tenant is looked at: another tenant's id is unknown
        found = self.orchestrator.abort(current_tenant(), request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def Tokenize(self, request, context) -> generation_pb2.TokenizeResponse:  # noqa: N802
        # NOTE: tokenizing (and rendering a chat) is CPU work: off the event loop
        return await asyncio.to_thread(tokenization.tokenize, request, self.tokenizer)

    async def Detokenize(self, request, context) -> generation_pb2.DetokenizeResponse:  # noqa: N802
        return await asyncio.to_thread(tokenization.detokenize, request, self.tokenizer, self.card)

    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:  # noqa: N802
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
            has_chat_template=self.tokenizer.chat.available,
            tool_call_parser=self.tokenizer.chat.tool_call_parser,
        )

    async def GetClusterStatus(self, request, context) -> generation_pb2.ClusterStatus:  # noqa: N802
        # NOTE: fresh loads, but a worker slower than this keeps its last one (marked stale):
        # the answer never waits long on a busy worker; membership is the poller's
        await self.workers.refresh(timeout_s=STATUS_POLL_S, sync_registry=False, patient=False)
        status = generation_pb2.ClusterStatus(index_degraded=self.policy.index_degraded)
        for w in self.workers.workers():
            role = common_pb2.WORKER_ROLE_PREFILL if w.role.value == "prefill" else None
            status.workers.add(
                worker_id=w.worker_id,
                role=role or common_pb2.WORKER_ROLE_DECODE,
                address=w.address,
                incarnation=w.incarnation,
                alive=w.healthy,
                restarts=w.restarts,
                load=load_to_proto(w.load, w.worker_id, w.role) if w.load is not None else None,
            )
        # NOTE: from the requests this router finished, wherever they were prefilled (a decode
        # worker computes short prompts under `pagedserve up`), as ClusterStatus documents
        status.prefix_cache_hit_rate = prefix_cache_hit_rate(self.metrics)
        return status


_SAMPLING_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)}


def request_field(worker_field: str) -> str:
    """The GenerateRequest path of a field a worker named: SamplingParams' fields (which the
    workers name bare, as `SamplingParams.validate` does) are under `sampling`."""
    head = worker_field.split(".", 1)[0].split("[", 1)[0]
    return f"sampling.{worker_field}" if head in _SAMPLING_FIELDS else worker_field
