"""What happened to a request, recorded once when it ends: metrics, span attributes, one log line.

The log line is structured (JSON) and never carries the prompt or the output text.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span

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
    reason: str | None = None


def reason_name(finish_reason: int) -> str:
    """`FINISH_REASON_STOP` -> "stop"."""
    name = common_pb2.FinishReason.Name(finish_reason)  # type: ignore[arg-type]
    return name.removeprefix("FINISH_REASON_").lower()


def request_attributes(
    req: RouterRequest, include_text: bool, request: generation_pb2.GenerateRequest
) -> dict:
    """The `router.generate` span's attributes at the start (the prompt text only if asked)."""
    attributes = {
        "gen_ai.request.id": req.request_id,
        "gen_ai.request.max_tokens": req.params.max_tokens,
        "gen_ai.request.temperature": req.params.temperature,
        "pagedserve.priority": req.priority,
    }
    if include_text and request.WhichOneof("prompt") == "text":
        attributes["gen_ai.prompt"] = request.text
    return attributes


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
    )
    span.set_attribute("gen_ai.usage.prompt_tokens", len(req.prompt_token_ids))
    span.set_attribute("gen_ai.usage.completion_tokens", outcome.generated)
    span.set_attribute("gen_ai.response.finish_reasons", [reason])
    if outcome.ttft_s is not None:
        span.set_attribute("gen_ai.latency.time_to_first_token", outcome.ttft_s)
    span.set_attribute("gen_ai.latency.e2e", e2e_s)
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
    )
