"""Tracing (OpenTelemetry, OTLP over gRPC or HTTP) and metrics (Prometheus) set-up shared by every
service.

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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
METRICS_PREFIX = "pagedserve:"
METRICS_NAMINGS = ("pagedserve", "vllm")  # --metrics-names
# pagedserve's suffix -> vLLM's, where vLLM names the same meaning differently (--metrics-names
# vllm); every other series keeps its suffix under the `vllm:` prefix
VLLM_SUFFIXES = {
    # per request (e2e - TTFT) / (tokens - 1): vLLM's per-request TPOT, not its inter-token one
    "time_per_output_token_seconds": "request_time_per_output_token_seconds",
}
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


OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # --otlp-traces-protocol


def traces_protocol(flag: str | None) -> str:
    """`--otlp-traces-protocol`, else the standard OTEL_EXPORTER_OTLP_{TRACES_,}PROTOCOL, else
    "grpc". ValueError naming the flag for anything but `OTLP_PROTOCOLS`."""
    protocol = (
        flag
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(
            f"--otlp-traces-protocol: {protocol!r} is not one of {', '.join(OTLP_PROTOCOLS)}"
        )
    return protocol


def setup_tracing(
    service_name: str,
    endpoint: str | None,
    *,
    include_text: bool = False,
    worker_id: str = "",
    protocol: str | None = None,
) -> Tracing:
    """A tracer exporting to `endpoint`, or a no-op: OTLP over gRPC (e.g. `http://jaeger:4317`)
    or, with `protocol` "http/protobuf", over HTTP (e.g. `http://jaeger:4318`; `/v1/traces` is
    added to an endpoint without a path)."""
    endpoint = traces_endpoint(endpoint)
    if endpoint is None:
        return Tracing(trace.NoOpTracer(), enabled=False, include_text=include_text)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service_name}
    if worker_id:
        attributes["service.instance.id"] = worker_id
    provider = TracerProvider(resource=Resource.create(attributes))
    exporter = _span_exporter(endpoint, traces_protocol(protocol))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    tracer = provider.get_tracer("pagedserve")
    return Tracing(tracer, enabled=True, include_text=include_text, _provider=provider)


def _span_exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "http/protobuf":
        from urllib.parse import urlsplit

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        if urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpSpanExporter(endpoint=endpoint, timeout=2)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    insecure = not endpoint.startswith("https://")
    return OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=2)


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


class ModelNameView:
    """`source`'s metrics as a scrape exports them: each `pagedserve:` family gets the label
    `model_name` on every sample and, with `naming` "vllm", the `vllm:` prefix and vLLM's suffix
    (`VLLM_SUFFIXES`). Other families (the client library's `process_*`, `python_*`) pass as
    they are. Computed at scrape time: the request paths never pay for it."""

    def __init__(self, source: Any, model_name: str, naming: str) -> None:
        if naming not in METRICS_NAMINGS:
            raise ValueError(
                f"--metrics-names: {naming!r} is not one of {', '.join(METRICS_NAMINGS)}"
            )
        self.source, self.model_name, self.naming = source, model_name, naming

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric

        for family in self.source.collect():
            if not family.name.startswith(METRICS_PREFIX):
                yield family
                continue
            name = self.rename(family.name)
            out = Metric(name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "model_name": self.model_name}
                suffix = sample.name[len(family.name) :]
                out.add_sample(name + suffix, labels, sample.value, sample.timestamp,
                               sample.exemplar)  # fmt: skip
            yield out

    def rename(self, name: str) -> str:
        """A family's exported name."""
        if self.naming == "pagedserve":
            return name
        suffix = name.removeprefix(METRICS_PREFIX)
        return "vllm:" + VLLM_SUFFIXES.get(suffix, suffix)


def export_registry(model_name: str, naming: str = "pagedserve", source: Any = None) -> Any:
    """The registry a `/metrics` endpoint serves: `source` (default: the process's) seen
    through `ModelNameView`."""
    from prometheus_client import REGISTRY, CollectorRegistry

    source = REGISTRY if source is None else source
    exported = CollectorRegistry(auto_describe=False)
    exported.register(ModelNameView(source, model_name, naming))
    return exported


def start_metrics_server(
    port: int | None, host: str = "0.0.0.0", model_name: str = "", naming: str = "pagedserve"
) -> int | None:
    """Serve Prometheus `/metrics` on `port` (0 picks one): the process's metrics with the label
    `model_name` and `naming`'s names (pagedserve/metrics.py: `export_registry`). Returns the
    port, None when off."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    registry = export_registry(model_name, naming)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
