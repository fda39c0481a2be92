"""Real OTLP trace receivers on loopback, built from `opentelemetry-proto` (no Jaeger binary
exists here): over gRPC (`OtlpReceiver`) and over HTTP (`OtlpHttpReceiver`, POST /v1/traces with
a protobuf body). Each collects every exported span for assertions."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    events: tuple[str, ...]
    status_code: str = "UNSET"  # UNSET, OK or ERROR


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.raw: list[bytes] = []  # every export request as received (to grep for leaks)
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(None)

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        self.collect(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def collect(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes
                 if a.key == "service.name"), "",
            )  # fmt: skip
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=tuple(e.name for e in span.events),
                            status_code=trace_pb2.Status.StatusCode.Name(
                                span.status.code
                            ).removeprefix("STATUS_CODE_"),
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self.raw.append(request.SerializeToString())

    def wait_for(self, predicate, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"spans not received in time: {[s.name for s in self.spans]}")


class OtlpHttpReceiver(OtlpReceiver):
    """OTLP over HTTP: `POST /v1/traces`, `application/x-protobuf`, as collectors take it on
    port 4318. `endpoint` is the base URL (the exporter adds /v1/traces)."""

    def __init__(self) -> None:  # NOTE: not the gRPC server of the base class
        self.spans = []
        self.raw = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                receiver.collect(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpHttpReceiver:
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None
