"""Tracing (OpenTelemetry, OTLP/gRPC) and metrics (Prometheus) set-up shared by every service.

Tracing is off unless `--otlp-traces-endpoint` or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
/ `OTEL_EXPORTER_OTLP_ENDPOINT` variables name a collector (read when `setup_tracing` runs, never at
import). The W3C `traceparent` travels in gRPC metadata on every hop and inside the `KvHandle`.
Shutdown flushes for at most `flush_timeout_s` (2 s), so a dead collector never delays a stop;
exports time out after 2 s and run on the batch processor's thread, never on a request's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_KEYS = ("traceparent", "tracestate")


@dataclass(slots=True)
class Tracing:
    """A service's tracer and how to stop it. `enabled` False means a no-op tracer."""

    tracer: trace.Tracer
    enabled: bool
    include_text: bool
    _provider: object | None = None
    flush_timeout_s: float = 2.0

    def shutdown(self) -> None:
        """Flush and stop the exporter, waiting at most `flush_timeout_s`."""
        provider = self._provider
        if provider is None:
            return
        worker = threading.Thread(target=provider.shutdown, daemon=True)  # type: ignore[attr-defined]
        worker.start()
        worker.join(self.flush_timeout_s)
        if worker.is_alive():
            log.warning("trace flush did not finish in %.1fs; spans dropped", self.flush_timeout_s)


def traces_endpoint(flag: str | None) -> str | None:
    return (
        flag
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def setup_tracing(
    service_name: str, endpoint: str | None, *, include_text: bool = False, worker_id: str = ""
) -> Tracing:
    """A tracer exporting to `endpoint` (OTLP/gRPC, e.g. `http://jaeger:4317`), or a no-op."""
    endpoint = traces_endpoint(endpoint)
    if endpoint is None:
        return Tracing(trace.NoOpTracer(), enabled=False, include_text=include_text)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service_name}
    if worker_id:
        attributes["service.instance.id"] = worker_id
    provider = TracerProvider(resource=Resource.create(attributes))
    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=2)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    tracer = provider.get_tracer("pagedserve")
    return Tracing(tracer, enabled=True, include_text=include_text, _provider=provider)


def context_from(carrier: Iterable[tuple[str, str]] | Mapping[str, str]) -> otel_context.Context:
    """The trace context carried by gRPC metadata pairs or a `KvHandle.trace_context` map."""
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    return _PROPAGATOR.extract({k: v for k, v in items if k in TRACE_KEYS})


def current_carrier(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) of `ctx` (default: the current span) for the next hop."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def span_context(span: trace.Span) -> otel_context.Context:
    """A context whose current span is `span`: the parent for its children and the next hop."""
    return trace.set_span_in_context(span)


def metadata(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    return list(current_carrier(ctx).items())


def start_metrics_server(port: int | None, host: str = "0.0.0.0") -> int | None:
    """Serve Prometheus `/metrics` on `port` (0 picks one); returns the port, None when off."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
