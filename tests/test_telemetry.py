"""Tracing set-up against a real OTLP receiver; a dead collector never blocks a stop."""

from __future__ import annotations

import time

import pytest
from support.otlp_receiver import OtlpHttpReceiver, OtlpReceiver

from pagedserve.telemetry import context_from, current_carrier, setup_tracing


def test_spans_reach_the_collector_with_the_parent_from_traceparent():
    receiver = OtlpReceiver().start()
    try:
        tracing = setup_tracing("svc-a", receiver.endpoint)
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        with tracing.tracer.start_as_current_span(
            "outer", context=context_from([("traceparent", parent)])
        ):
            carrier = current_carrier()
            with tracing.tracer.start_as_current_span("inner"):
                pass
        tracing.shutdown()
        spans = receiver.wait_for(lambda s: len(s) == 2)
    finally:
        receiver.stop()
    by_name = {s.name: s for s in spans}
    assert {s.trace_id for s in spans} == {"0af7651916cd43dd8448eb211c80319c"}
    assert by_name["outer"].parent_span_id == "b7ad6b7169203331"
    assert by_name["inner"].parent_span_id == by_name["outer"].span_id
    assert by_name["outer"].service == "svc-a"
    assert carrier["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    tracing = setup_tracing("svc", None)
    assert not tracing.enabled
    with tracing.tracer.start_as_current_span("x"):
        assert current_carrier() == {}


def test_an_unreachable_collector_costs_at_most_the_flush_timeout():
    tracing = setup_tracing("svc", "http://127.0.0.1:9")  # nothing listens on port 9
    for _ in range(50):
        with tracing.tracer.start_as_current_span("lost"):
            pass
    start = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_spans_reach_an_otlp_http_collector(how, monkeypatch):
    receiver = OtlpHttpReceiver().start()
    try:
        if how == "flag":
            tracing = setup_tracing("svc-h", receiver.endpoint, protocol="http/protobuf")
        else:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
            tracing = setup_tracing("svc-h", receiver.endpoint)
        with tracing.tracer.start_as_current_span("over-http"):
            pass
        tracing.shutdown()
        spans = receiver.wait_for(lambda s: len(s) == 1)
    finally:
        receiver.stop()
    assert (spans[0].name, spans[0].service) == ("over-http", "svc-h")
    assert receiver.paths == ["/v1/traces"]


def test_an_unknown_otlp_protocol_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--otlp-traces-protocol: 'http/json'"):
        setup_tracing("svc", "http://127.0.0.1:9", protocol="http/json")
