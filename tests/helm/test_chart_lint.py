"""Lint, schemas and scanners: `helm lint --strict` (Helm 4 and Helm 3, which must render the
same), values.schema.json, the Kubernetes OpenAPI schemas of two minors (kubernetes-validate
--strict) and checkov on every render and the Dockerfile."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chart import (
    CHART,
    LINUX_AMD64_ONLY,
    MATRIX,
    ROOT,
    Doc,
    Tools,
    _set,
    deployment,
    helm_template,
    render,
)

pytestmark = LINUX_AMD64_ONLY


KUBERNETES_MINORS = ("1.31.0", "1.37.0")  # the chart's kubeVersion floor and the newest bundled
CRD_API_VERSIONS = (
    "monitoring.coreos.com/v1",
    "cert-manager.io/v1",
    "keda.sh/v1alpha1",
    "gateway.networking.k8s.io/v1",
)


@pytest.mark.parametrize("major", ["helm4", "helm3"])
@pytest.mark.parametrize(
    "case",
    [
        "defaults", "gpu", "keda", "servicemonitor-without-api", "tracing",
        "gateway-ingress-restricted",
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
