"""One trace per request across router -> prefill -> decode, received by a real OTLP/gRPC
collector on loopback; Prometheus metrics that move; a dead collector never hurts serving."""

from __future__ import annotations

import re
import threading
import urllib.request

import grpc
import pytest
from support.clusters import up_args
from support.metric_docs import documented_metrics
from support.oracle import make_prompts
from support.otlp_receiver import OtlpReceiver
from support.probes import samples, scrape

from pagedserve.client import Client
from pagedserve.launcher import start_cluster
from pagedserve.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)


@pytest.fixture(scope="module")
def traced(make_tiny, clusters):
    receiver = OtlpReceiver().start()
    # NOTE: 512 KiB of KV is 64 blocks of 16 tokens for the tiny model: four requests of
    # 200 + 90 tokens need 76, so the decode worker must preempt.
    flags = dict(kv_cache_memory="512KiB", otlp_traces_endpoint=receiver.endpoint, metrics=True)
    with clusters.private(make_tiny("llama"), **flags) as cluster:
        yield cluster, receiver
    receiver.stop()


def test_one_trace_per_request_with_parent_links_transfer_and_preemption(traced):
    cluster, receiver = traced
    prompts = make_prompts((200, 200, 200, 200), seed=61)
    traces = {f"{i + 1:032x}": f"{i + 17:016x}" for i in range(len(prompts))}
    outcomes = []

    def run(trace_id: str, parent_id: str, prompt: list[int]) -> None:
        with Client(cluster.router_address) as client:
            stream = client.stub.Generate(
                _request(prompt),
                timeout=120,
                metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")],
            )
            outcomes.append(list(stream)[-1].finish_reason)

    threads = [
        threading.Thread(target=run, args=(t, p, prompt))
        for (t, p), prompt in zip(traces.items(), prompts, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(outcomes) == len(prompts) and all(outcomes)

    names = {"router.generate", "router.route", "prefill.queue", "prefill.compute",
             "decode.run", "kv.transfer", "decode.queue"}  # fmt: skip

    def complete(spans) -> bool:
        return all(
            names <= {s.name for s in spans if s.trace_id == trace_id} for trace_id in traces
        )

    spans = receiver.wait_for(complete, timeout_s=20)
    preempted = False
    for trace_id, client_span in traces.items():
        mine = {s.name: s for s in spans if s.trace_id == trace_id}
        root = mine["router.generate"]
        assert root.parent_span_id == client_span
        assert root.service == "pagedserve-router"
        for name in ("router.route", "prefill.queue", "prefill.compute", "decode.run"):
            assert mine[name].parent_span_id == root.span_id, name
        assert mine["prefill.compute"].service == "pagedserve-prefill"
        assert mine["decode.run"].service == "pagedserve-decode"
        for name in ("kv.transfer", "decode.queue"):
            assert mine[name].parent_span_id == mine["decode.run"].span_id, name
        assert mine["kv.transfer"].attributes["pagedserve.kv.transport"] in ("shm", "grpc")
        route = mine["router.route"].attributes
        assert route["pagedserve.route.uncached_prefill_blocks"] >= 0
        assert route["pagedserve.route.index_degraded"] is False  # a boolean, not 0.0
        generate = root.attributes
        assert generate["gen_ai.operation.name"] == "text_completion"
        assert generate["gen_ai.request.model"] and generate["gen_ai.provider.name"]
        assert generate["gen_ai.request.max_tokens"] == 90
        assert generate["gen_ai.usage.input_tokens"] == 200
        assert generate["gen_ai.usage.output_tokens"] == 90
        assert generate["gen_ai.response.finish_reasons"] == ("length",)
        assert generate["pagedserve.stream"] is True
        preempted |= "preempt" in mine["decode.run"].events
    assert preempted, "the small decode pool should have forced a preemption"


def test_prompt_and_output_text_stay_out_of_spans_and_logs(traced):
    """`--trace-include-text` is off: no span attribute, event or resource of any service, and
    no log line, holds the prompt or the generated text (it may hold token counts and ids)."""
    cluster, receiver = traced
    marker = "Zebra quartz 7781 is the private prompt"
    before = sum(s.name == "decode.run" for s in receiver.spans)
    with Client(cluster.router_address) as client:
        parts = list(
            client.generate(
                marker, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), timeout=60
            )
        )
    output = "".join(p.text for p in parts)
    assert len(output) >= 4 and parts[-1].finish_reason
    receiver.wait_for(lambda spans: sum(s.name == "decode.run" for s in spans) > before, 20)
    exported = b"".join(receiver.raw)
    assert (
        b"router.generate" in exported and b"pagedserve-decode" in exported
    )  # the grep sees spans
    for secret in (marker, "Zebra quartz", output):
        assert secret.encode() not in exported, f"{secret!r} exported in a span"
        for child in cluster.children:
            assert secret not in child.log_path.read_text(errors="replace"), child.name


def test_metrics_endpoints_expose_names_that_move(traced):
    cluster, _ = traced
    ports = {c.name: c.metrics_port for c in cluster.children if c.metrics_port}
    router_before = scrape(ports["router"])
    with Client(cluster.router_address) as client:
        parts = list(client.generate(make_prompts((20,), seed=62)[0], LONG, timeout=60))
    assert parts[-1].finish_reason
    router = scrape(ports["router"])
    key = 'pagedserve:request_success_total{finished_reason="length"}'
    assert router[key] == router_before.get(key, 0) + 1
    assert router["pagedserve:generation_tokens_total"] >= 90
    assert router["pagedserve:time_to_first_token_seconds_count"] >= 1
    assert "pagedserve:index_degraded" in router

    decode = scrape(ports["decode-0"])
    assert decode["pagedserve:num_preemptions_total"] >= 1  # from the previous test's load
    assert (
        decode["pagedserve:decode_num_preemptions_swap_total"]
        + decode["pagedserve:decode_num_preemptions_recompute_total"]
        == decode["pagedserve:num_preemptions_total"]
    )
    assert "pagedserve:kv_cache_usage_perc" in decode
    prefill = scrape(ports["prefill-0"])
    assert prefill["pagedserve:kv_leases_granted_total"] >= 5
    assert prefill["pagedserve:kv_leases_active"] == 0
    assert prefill["pagedserve:prefix_cache_queries_total"] >= 820
    assert decode["pagedserve:kv_transfer_bytes_shm_total"] > 0


# the request histograms each service observes (docs/metrics.md, "Request phases")
PHASES = {
    "router": ("inter_token_latency_seconds", "request_decode_time_seconds",
               "request_prompt_tokens", "request_generation_tokens"),
    "prefill-0": ("request_queue_time_seconds", "request_prefill_time_seconds",
                  "request_prompt_tokens"),
    "decode-0": ("request_queue_time_seconds", "request_decode_time_seconds",
                 "request_generation_tokens"),
}  # fmt: skip
SECTIONS = {"router": "Router", "prefill-0": "Prefill worker", "decode-0": "Decode worker"}
# labelled counters whose first sample comes with their first event
AFTER_THEIR_EVENT = {"pagedserve:requests_rejected_total", "pagedserve:requests_aborted_total"}


def test_every_series_names_the_model_and_each_service_observes_its_phases(traced, make_tiny):
    cluster, _ = traced
    model_dir = make_tiny("llama")
    ports = {c.name: c.metrics_port for c in cluster.children if c.metrics_port}
    with Client(cluster.router_address) as client:
        list(client.generate(make_prompts((30,), seed=63)[0], LONG, timeout=60))
    for service, phases in PHASES.items():
        names: set[str] = set()
        scraped = samples(metrics_page(ports[service]), names)
        assert names == {model_dir.name}, service  # every series, one model
        for phase in phases:
            assert scraped[f"pagedserve:{phase}_count"] >= 1, (service, phase)
        families = {re.sub(r"\{.*$", "", k) for k in scraped}
        families |= {re.sub(r"_(bucket|count|sum|created)$", "", f) for f in families}
        documented = documented_metrics(SECTIONS[service], optional=False)
        missing = documented - families - AFTER_THEIR_EVENT
        assert not missing, (service, missing)


def metrics_page(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


# vLLM's request metrics (docs.vllm.ai, "Production Metrics", v1), as `--metrics-names vllm`
# exports them across a cluster's services
VLLM_SERIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
    "vllm:request_time_per_output_token_seconds_count",
}  # fmt: skip


def test_vllm_names_cover_vllm_request_metrics_on_every_service(make_tiny, clusters):
    model_dir = make_tiny("llama")
    with clusters.private(model_dir, metrics=True, metrics_names="vllm", http_port=0) as cluster:
        with Client(cluster.router_address) as client:
            list(client.generate(make_prompts((30,), seed=64)[0], LONG, timeout=60))
        seen: set[str] = set()
        for child in cluster.children:
            if child.metrics_port is None and child.name != "gateway":
                continue
            port = child.metrics_port or int(cluster.http_url.rsplit(":", 1)[1])
            names: set[str] = set()
            scraped = samples(metrics_page(port), names)
            assert names == {model_dir.name}, child.name
            assert not [k for k in scraped if k.startswith("pagedserve:")], child.name
            seen |= {re.sub(r"\{.*$", "", k) for k in scraped}
    assert seen >= VLLM_SERIES, VLLM_SERIES - seen
    assert "vllm:gateway_requests_in_flight" in seen


def test_an_unreachable_collector_does_not_hurt_serving_or_stopping(make_tiny, tmp_path_factory):
    args = up_args(
        make_tiny("llama"), otlp_traces_endpoint="http://127.0.0.1:9", kv_cache_memory="4MiB"
    )
    cluster = start_cluster(args, tmp_path_factory.mktemp("dead-collector-logs"))
    try:
        with Client(cluster.router_address) as client:
            parts = list(client.generate(make_prompts((30,), seed=63)[0], LONG, timeout=60))
        assert parts[-1].finish_reason
    finally:
        cluster.stop(timeout_s=20)
    # NOTE: a child that missed the grace time was killed, and would show -9 here
    codes = {c.name: c.proc.returncode for c in cluster.children if c.name != "redis"}
    assert set(codes.values()) == {0}, codes


def _request(prompt):
    from pagedserve.protoconv import sampling_to_proto
    from pagedserve.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(stream=True, sampling=sampling_to_proto(LONG))
    request.token_ids.ids.extend(prompt)
    return request


def test_a_rejected_request_is_a_span_with_the_field(traced):
    cluster, receiver = traced
    trace_id, parent = "00000000000000000000000000abcdef", "00000000000000aa"
    request = _request([5, 6, 7])
    request.sampling.top_p = 1.5
    metadata = [("traceparent", f"00-{trace_id}-{parent}-01")]
    with Client(cluster.router_address) as client, pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request, timeout=30, metadata=metadata))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait_for(lambda spans: any(s.trace_id == trace_id for s in spans), 20)
    (span,) = [s for s in spans if s.trace_id == trace_id]
    assert span.name == "router.generate" and span.parent_span_id == parent
    assert span.status_code == "ERROR"
    assert span.attributes["pagedserve.error.field"] == "sampling.top_p"
    assert span.attributes["error.type"] == "InvalidArgument"


def test_every_worker_reports_when_its_load_was_taken(traced):
    cluster, _ = traced
    with Client(cluster.router_address) as client:
        status = client.status()
    assert len(status.workers) == 2
    for worker in status.workers:
        assert worker.load.reported_at_unix_ms > 1_700_000_000_000, worker.worker_id
