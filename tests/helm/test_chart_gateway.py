"""The gateway (the OpenAI-compatible HTTP API): a client of the router, its probes, Service,
Ingress, HTTPRoute, NetworkPolicy, HTTPS and scheduling."""

from __future__ import annotations

import pytest
from chart import (
    GATEWAY,
    GATEWAY_PORT,
    INGRESS_HOST,
    LINUX_AMD64_ONLY,
    MATRIX,
    NAMESPACE,
    OTLP,
    PROBES,
    PRODUCTION,
    RELEASE,
    TLS_CASES,
    TLS_DIR,
    TLS_SECRET,
    Doc,
    Tools,
    _set,
    container,
    deployment,
    flag,
    kind_counts,
    of_kind,
    render,
)

from pagedserve.cli import build_parser

pytestmark = LINUX_AMD64_ONLY


# the gateways' target: every router pod (headless Service), round-robin, on the container port
ROUTER_ADDRESS = f"dns:///{RELEASE}-pagedserve-router-headless.{NAMESPACE}.svc:50051"


def selects(peer: Doc, labels: dict[str, str]) -> bool:
    """A same-namespace podSelector peer that matches pods with these labels."""
    wanted = peer.get("podSelector", {}).get("matchLabels")
    return (
        "namespaceSelector" not in peer and wanted is not None and wanted.items() <= labels.items()
    )


def network_policy(docs: list[Doc], role: str) -> Doc:
    (found,) = [d for d in of_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith(role)]
    return found


def gateway_pods(docs: list[Doc]) -> dict[str, str]:
    return deployment(docs, "gateway")["spec"]["template"]["metadata"]["labels"]


def test_gateway_renders_by_default_as_a_client_of_the_router(
    renders: dict[str, list[Doc]],
) -> None:
    docs = renders["defaults"]
    box = container(docs, "gateway")
    args = box["args"]
    assert args[0] == "gateway"
    # NOTE: every router pod through the headless Service, round-robin, on the container port
    headless = f"{RELEASE}-pagedserve-router-headless"
    assert flag(args, "--router") == ROUTER_ADDRESS
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == headless)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert (flag(args, "--host"), flag(args, "--port")) == ("0.0.0.0", str(GATEWAY_PORT))
    assert flag(args, "--drain-timeout") == "30"
    assert "--request-timeout" not in args  # null: no limit
    assert {"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"} in box["ports"]
    # torch-free and stateless: no model, no Redis, no /dev/shm, no GPU, no torch threads
    for absent in ("--model", "--redis-url", "--device", "--otlp-traces-endpoint"):
        assert absent not in args
    pod = deployment(docs, "gateway")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert [m["mountPath"] for m in box["volumeMounts"]] == ["/tmp"]
    assert "OMP_NUM_THREADS" not in {e["name"] for e in box.get("env", [])}
    assert "nvidia.com/gpu" not in box["resources"]["limits"]
    assert box["resources"]["requests"] == {"cpu": "250m", "memory": "256Mi"}
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 15


def test_gateway_probes_are_http_on_health_and_livez(renders: dict[str, list[Doc]]) -> None:
    box = container(renders["defaults"], "gateway")
    assert box["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert box["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert box["startupProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert "grpc" not in box[probe]


def test_gateway_service_speaks_http(renders: dict[str, list[Doc]]) -> None:
    (service,) = [
        s for s in of_kind(renders["defaults"], "Service") if s["metadata"]["name"] == GATEWAY
    ]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP",
         "appProtocol": "http"},
    ]  # fmt: skip
    (budget,) = [p for p in of_kind(renders["defaults"], "PodDisruptionBudget")
                 if p["metadata"]["name"] == GATEWAY]  # fmt: skip
    assert budget["spec"]["maxUnavailable"] == 1
    assert of_kind(renders["defaults"], "Ingress") == []


@pytest.mark.parametrize("case", [c for c in MATRIX if c != "gateway-off"])
def test_gateway_args_parse_with_the_cli(renders: dict[str, list[Doc]], case: str) -> None:
    args = build_parser().parse_args(container(renders[case], "gateway")["args"])
    assert args.command == "gateway"
    assert args.func.__name__ == "_run_gateway"
    assert (args.router, args.host, args.port) == (ROUTER_ADDRESS, "0.0.0.0", GATEWAY_PORT)
    assert args.otlp_traces_endpoint == (OTLP if case == "tracing" else None)
    assert args.request_timeout == (600.0 if case == "gateway-ingress-restricted" else None)
    # TLS to the router only with tls.enabled; the router serves plaintext gRPC otherwise
    assert args.tls_ca == (f"{TLS_DIR}/ca.crt" if case in TLS_CASES else None)


def test_gateway_disabled_renders_none_of_it(renders: dict[str, list[Doc]]) -> None:
    docs = renders["gateway-off"]
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/component"] != "gateway", doc["kind"]
    assert kind_counts(docs) == {
        "Deployment": 3,
        "Service": 4,
        "StatefulSet": 1,
        "PodDisruptionBudget": 3,
        "NetworkPolicy": 5,
        "ServiceAccount": 1,
        "Pod": 1,  # the `helm test` hook, and its NetworkPolicy
    }
    assert "from" not in network_policy(docs, "router")["spec"]["ingress"][0]


def test_gateway_ingress_points_at_the_gateway_service(renders: dict[str, list[Doc]]) -> None:
    docs = renders["gateway-ingress-restricted"]
    (ingress,) = of_kind(docs, "Ingress")
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["metadata"]["name"] == GATEWAY
    annotations = ingress["metadata"]["annotations"]
    assert annotations == {"nginx.ingress.kubernetes.io/proxy-buffering": "off"}
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"secretName": "api-tls", "hosts": [INGRESS_HOST]}]
    (rule,) = spec["rules"]
    assert rule["host"] == INGRESS_HOST
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == GATEWAY]
    (port,) = service["spec"]["ports"]
    assert path["backend"]["service"] == {"name": GATEWAY, "port": {"number": port["port"]}}


def test_network_policy_lets_gateway_pods_reach_the_router(renders: dict[str, list[Doc]]) -> None:
    # defaults: routerFrom is empty, so both accept everyone (gateway pods included)
    docs = renders["defaults"]
    for role, port in (("router", 50051), ("gateway", GATEWAY_PORT)):
        (rule,) = network_policy(docs, role)["spec"]["ingress"]
        assert rule == {"ports": [{"port": port, "protocol": "TCP"}]}, role
    # routerFrom set: the router also admits the gateway's pods on its gRPC port
    docs = renders["gateway-ingress-restricted"]
    apps = {"namespaceSelector": {"matchLabels": {"team": "apps"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}
    router_rules = network_policy(docs, "router")["spec"]["ingress"]
    (grpc,) = [r for r in router_rules if r["ports"] == [{"port": 50051, "protocol": "TCP"}]]
    assert apps in grpc["from"]
    assert any(selects(peer, gateway_pods(docs)) for peer in grpc["from"])
    # the gateway admits routerFrom, the ingress controller and the scrapers on its HTTP port
    policy = network_policy(docs, "gateway")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= gateway_pods(docs).items()
    (http,) = policy["ingress"]
    assert http["ports"] == [{"port": GATEWAY_PORT, "protocol": "TCP"}]
    ingress_nginx = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    }
    assert http["from"] == [apps, ingress_nginx, monitoring]


def test_gateway_scheduling_values_reach_its_pod(tools: Tools) -> None:
    docs = render(
        tools.helm4,
        _set(
            "gateway.nodeSelector.pool=cpu",
            "gateway.priorityClassName=frontend",
            "gateway.podAnnotations.team=api",
            "gateway.extraArgs[0]=--tls-ca=/etc/ca/ca.crt",
            "gateway.extraEnv[0].name=OTEL_SERVICE_NAME",
            "gateway.extraEnv[0].value=api",
            "gateway.service.type=LoadBalancer",
            "gateway.service.port=80",
        ),
    )
    template = deployment(docs, "gateway")["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert template["spec"]["priorityClassName"] == "frontend"
    assert template["metadata"]["annotations"] == {"team": "api"}
    box = template["spec"]["containers"][0]
    assert box["args"][-1] == "--tls-ca=/etc/ca/ca.crt"
    assert box["env"] == [{"name": "OTEL_SERVICE_NAME", "value": "api"}]
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == GATEWAY]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"][0]["port"] == 80
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_http_route_attaches_the_gateway_service(
    tools: Tools, renders: dict[str, list[Doc]]
) -> None:
    docs = renders["production"]
    (route,) = of_kind(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert spec["parentRefs"] == [
        {"name": "public", "namespace": "gateway-system", "sectionName": "https"}
    ]
    assert spec["hostnames"] == [INGRESS_HOST]
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == GATEWAY]
    assert rule["backendRefs"] == [{"name": GATEWAY, "port": service["spec"]["ports"][0]["port"]}]
    assert of_kind(renders["defaults"], "HTTPRoute") == []
    # with routerFrom set, the Gateway's proxies (ingressControllerFrom) may reach the gateway
    restricted = render(
        tools.helm4,
        [*PRODUCTION, *_set("networkPolicy.routerFrom[0].namespaceSelector.matchLabels.team=apps",
                            "gateway.ingress.enabled=false")],
    )  # fmt: skip
    (http,) = network_policy(restricted, "gateway")["spec"]["ingress"]
    proxies = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    }
    assert proxies in http["from"]


def test_gateway_https_reaches_probes_service_and_scraper(renders: dict[str, list[Doc]]) -> None:
    docs = renders["production-monitoring-api"]
    box = container(docs, "gateway")
    for probe in PROBES:
        assert box[probe]["httpGet"]["scheme"] == "HTTPS"
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == GATEWAY]
    assert service["spec"]["ports"][0]["appProtocol"] == "https"
    (monitor,) = of_kind(docs, "ServiceMonitor")
    (http,) = [e for e in monitor["spec"]["endpoints"] if e["port"] == "http"]
    assert http["scheme"] == "https"
    assert http["tlsConfig"] == {
        "ca": {"secret": {"name": TLS_SECRET, "key": "ca.crt"}},
        "serverName": f"{GATEWAY}.{NAMESPACE}.svc",
    }
    assert f"{GATEWAY}.{NAMESPACE}.svc" in of_kind(docs, "Certificate")[0]["spec"]["dnsNames"]
