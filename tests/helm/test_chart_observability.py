"""Metrics and traces in the chart: the ServiceMonitor, the metrics and tracing flags, and the
Grafana dashboard, which charts only documented metrics."""

from __future__ import annotations

import json
import re

from chart import (
    LINUX_AMD64_ONLY,
    NAMESPACE,
    OTLP,
    PENDING_FLAGS,
    RELEASE,
    ROLES,
    Doc,
    container,
    flag,
    of_kind,
)
from support.metric_docs import documented_metrics

pytestmark = LINUX_AMD64_ONLY


def test_service_monitor_only_when_the_api_exists(renders: dict[str, list[Doc]]) -> None:
    assert of_kind(renders["servicemonitor-without-api"], "ServiceMonitor") == []
    (monitor,) = of_kind(renders["servicemonitor-with-api"], "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    # NOTE: the gateway serves /metrics on its HTTP port; only its Service has a port named http.
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics"),
        ("http", "/metrics"),
    ]
    (components,) = monitor["spec"]["selector"]["matchExpressions"]
    assert components["values"] == [*ROLES, "gateway"]
    for name in ("servicemonitor-without-api", "servicemonitor-with-api"):
        docs = renders[name]
        for role in ROLES:
            box = container(docs, role)
            assert flag(box["args"], "--metrics-port") == "9090"
            assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in box["ports"]
        for service in of_kind(docs, "Service"):
            # NOTE: the router's headless Service (the gateways' target) has no metrics port, so
            # the ServiceMonitor, which selects it too, scrapes each router once
            if not service["metadata"]["name"].endswith(("redis", "gateway", "-headless")):
                assert "metrics" in [p["name"] for p in service["spec"]["ports"]]
        gateway = container(docs, "gateway")
        assert "--metrics-port" not in gateway["args"]  # /metrics is on its HTTP port
        assert [p["name"] for p in gateway["ports"]] == ["http"]


def test_metrics_and_tracing_flags_are_off_by_default(renders: dict[str, list[Doc]]) -> None:
    for role in ROLES:
        args = container(renders["defaults"], role)["args"]
        assert not set(PENDING_FLAGS) & set(args)


def test_tracing_reaches_every_role(renders: dict[str, list[Doc]]) -> None:
    for role in ROLES:
        args = container(renders["tracing"], role)["args"]
        assert flag(args, "--otlp-traces-endpoint") == OTLP
        assert "--trace-include-text" in args
        assert "--trace-include-text" not in container(renders["defaults"], role)["args"]


def test_dashboard_charts_documented_metrics(renders: dict[str, list[Doc]]) -> None:
    docs = renders["production"]
    (config,) = [
        c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("dashboard")
    ]
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["pagedserve.json"])
    assert len(dashboard["uid"]) <= 40  # Grafana's limit
    assert not re.search(r"__[A-Z]+__", json.dumps(dashboard))  # every placeholder filled
    constants = {
        v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"
    }
    assert constants == {"namespace": NAMESPACE, "release": f"{RELEASE}-pagedserve"}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {
        re.sub(r"_bucket$", "", name)
        for expr in exprs for name in re.findall(r"pagedserve:[a-z_]+", expr)
    }  # fmt: skip
    assert used <= documented_metrics(), used - documented_metrics()
    for wanted in (
        "pagedserve:kv_cache_usage_perc", "pagedserve:decode_num_swap_out_bytes_total",
        "pagedserve:decode_num_preemptions_swap_total", "pagedserve:prompt_tokens_cached_total",
        "pagedserve:time_to_first_token_seconds", "pagedserve:time_per_output_token_seconds",
        "pagedserve:num_requests_waiting", "pagedserve:gateway_requests_total",
    ):  # fmt: skip
        assert wanted in used, wanted
    assert any("histogram_quantile(0.99" in e for e in exprs)
    assert any("by (status)" in e for e in exprs)
    assert of_kind(renders["defaults"], "ConfigMap") == []
