"""What happened to a request, recorded once when it ends: metrics, span attributes, one log line.

The log line is structured (JSON) and never carries the prompt or the output text.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import Span, Status, StatusCode, Tracer

from pagedserve.errors import InvalidArgument
from pagedserve.metrics import RequestMetrics
from pagedserve.router.convert import RouterRequest
from pagedserve.v1 import common_pb2, generation_pb2

# NOTE: the logger the line was always written by, so log filters on it keep working
log = logging.getLogger("pagedserve.router.servicer")


@dataclass(slots=True)
class Outcome:
    """Filled in while the request runs; `reason` None at the end: it aborted or failed."""

    started: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    generated: int = 0
    cached: int = 0  # prompt tokens a prefix cache served
    reason: str | None = None
    # (gap since the previous tokens, how many arrived): inter-token latency as streamed
    on_tokens: Callable[[float, int], None] | None = None
    last_tokens_at: float = 0.0

    def first_token(self) -> None:
        """The client got its first token now (kept: a moved stream's restart is not one)."""
        if self.ttft_s is None:
            self.last_tokens_at = time.monotonic()
            self.ttft_s = self.last_tokens_at - self.started

    def count(self, generated: int, cached: int) -> None:
        """The tokens the client got so far, and the prompt tokens a prefix cache served."""
        new = generated - max(self.generated, 1)  # NOTE: the first token is TTFT's, not a gap
        if new > 0 and self.last_tokens_at and self.on_tokens is not None:
            now = time.monotonic()
            self.on_tokens(now - self.last_tokens_at, new)
            self.last_tokens_at = now
        self.generated, self.cached = generated, cached


def reason_name(finish_reason: int) -> str:
    """`FINISH_REASON_STOP` -> "stop"."""
    name = common_pb2.FinishReason.Name(finish_reason)  # type: ignore[arg-type]
    return name.removeprefix("FINISH_REASON_").lower()


def request_attributes(
    req: RouterRequest, include_text: bool, request: generation_pb2.GenerateRequest, model: str
) -> dict:
    """The `router.generate` span's attributes at the start: the OpenTelemetry GenAI semantic
    conventions where they apply, `pagedserve.*` for the rest (the prompt text only if asked)."""
    params = req.params
    attributes: dict = {
        "gen_ai.operation.name": operation_name(request),
        "gen_ai.provider.name": "pagedserve",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.top_k": params.top_k,
        "gen_ai.request.presence_penalty": params.presence_penalty,
        "gen_ai.request.frequency_penalty": params.frequency_penalty,
        "gen_ai.response.id": req.request_id,
        "pagedserve.request_id": req.request_id,
        "pagedserve.priority": req.priority,
        "pagedserve.stream": req.stream,
    }
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    if include_text and request.WhichOneof("prompt") == "text":
        attributes["pagedserve.prompt.text"] = request.text
    return attributes


def operation_name(request: generation_pb2.GenerateRequest) -> str:
    """GenAI's `gen_ai.operation.name`: `chat` for a conversation, else `text_completion`."""
    return "chat" if request.WhichOneof("prompt") == "messages" else "text_completion"


def rejected(tracer: Tracer, request: generation_pb2.GenerateRequest, parent, model: str,
             error: Exception) -> None:  # fmt: skip
    """A `router.generate` span for a request refused before it ran (status ERROR; the field
    and the reason), so that a rejected request is in the trace too."""
    attributes: dict = {
        "gen_ai.operation.name": operation_name(request),
        "gen_ai.provider.name": "pagedserve",
        "gen_ai.request.model": model,
        "error.type": type(error).__name__,
        "pagedserve.request_id": request.request_id,
    }
    if isinstance(error, InvalidArgument):
        attributes["pagedserve.error.field"] = error.field
    span = tracer.start_span("router.generate", context=parent, attributes=attributes)
    span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def record(
    metrics: RequestMetrics,
    span: Span,
    req: RouterRequest,
    tenant: str,
    outcome: Outcome,
    aborted: bool,
    e2e_s: float,
) -> None:
    """Count the request's end, set the span's usage and latency attributes, end the span, log."""
    reason = outcome.reason or ("abort" if aborted else "error")
    if reason == "abort":
        metrics.aborted.labels(cause="client").inc()
    metrics.finished(
        reason=reason,
        prompt=len(req.prompt_token_ids),
        generated=outcome.generated,
        ttft_s=outcome.ttft_s,
        e2e_s=e2e_s,
        cached=outcome.cached,
    )
    span.set_attribute("gen_ai.usage.input_tokens", len(req.prompt_token_ids))
    span.set_attribute("gen_ai.usage.output_tokens", outcome.generated)
    span.set_attribute("gen_ai.response.finish_reasons", [reason])
    if outcome.ttft_s is not None:
        span.set_attribute("pagedserve.latency.time_to_first_token_s", outcome.ttft_s)
    span.set_attribute("pagedserve.latency.e2e_s", e2e_s)
    trace_id = span.get_span_context().trace_id
    span.end()
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
        extra={"request_id": req.request_id},
    )
