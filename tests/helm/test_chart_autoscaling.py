"""Autoscaling: an HPA for every role that owns its replicas; workers scale on queue depth,
with the HPA or with a KEDA ScaledObject (never both), and scale to zero only with a wake-up
trigger."""

from __future__ import annotations

import pytest
from chart import (
    LINUX_AMD64_ONLY,
    NAMESPACE,
    RELEASE,
    ROLES,
    Doc,
    Tools,
    _set,
    deployment,
    helm_template,
    of_kind,
)

pytestmark = LINUX_AMD64_ONLY


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


def scaled_object(docs: list[Doc], role: str) -> Doc:
    (found,) = [
        s for s in of_kind(docs, "ScaledObject")
        if s["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-pagedserve-{role}"
    ]  # fmt: skip
    return found


def test_keda_scales_workers_on_their_queue_in_place_of_the_hpa(
    renders: dict[str, list[Doc]],
) -> None:
    """A ScaledObject per worker role on the queue the HPA's adapter rule reads (queried from
    Prometheus by KEDA itself), no chart HPA (KEDA makes its own), and the Deployment's replicas
    left to it; decode scales to zero with its cron wake-up trigger."""
    docs = renders["keda"]
    assert of_kind(docs, "HorizontalPodAutoscaler") == []
    assert len(of_kind(docs, "ScaledObject")) == 2
    for role, threshold in (("prefill", "4"), ("decode", "8")):
        so = scaled_object(docs, role)
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": f"{RELEASE}-pagedserve-{role}",
        }  # fmt: skip
        queue = so["spec"]["triggers"][0]
        assert queue["type"] == "prometheus" and queue["metricType"] == "AverageValue"
        meta = queue["metadata"]
        assert meta["query"] == (
            f'sum(pagedserve:num_requests_waiting{{namespace="{NAMESPACE}",'
            f'service="{RELEASE}-pagedserve-{role}"}})'
        )
        assert (meta["threshold"], meta["activationThreshold"]) == (threshold, "0")
        assert meta["serverAddress"].startswith("http")
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is map[string]string
        assert "replicas" not in deployment(docs, role)["spec"]
    decode = scaled_object(docs, "decode")["spec"]
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (0, 6)
    assert [t["type"] for t in decode["triggers"]] == ["prometheus", "cron"]
    assert decode["triggers"][1]["metadata"]["desiredReplicas"] == "1"
    assert scaled_object(docs, "prefill")["spec"]["minReplicaCount"] == 1
    for role in ("router", "gateway"):
        assert "replicas" in deployment(docs, role)["spec"]  # KEDA is for workers only
    assert of_kind(renders["defaults"], "ScaledObject") == []
    assert of_kind(renders["hpa"], "ScaledObject") == []


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        # the HPA and KEDA would both scale the Deployment
        (["metrics.enabled=true", "decode.autoscaling.enabled=true",
          "decode.autoscaling.keda.enabled=true"], "both scale the Deployment"),
        (["prefill.autoscaling.keda.enabled=true"], "metrics.enabled"),
        # at zero nothing exports the queue, and the router is out of its Service: no wake-up
        (["metrics.enabled=true", "decode.autoscaling.keda.enabled=true",
          "decode.autoscaling.keda.minReplicaCount=0"], "wake-up trigger"),
        (["metrics.enabled=true", "decode.autoscaling.keda.enabled=true",
          "decode.autoscaling.keda.minReplicaCount=5"], "maxReplicaCount < minReplicaCount"),
    ],
)  # fmt: skip
def test_unsafe_keda_values_are_refused(tools: Tools, values: list[str], needle: str) -> None:
    result = helm_template(tools.helm4, _set(*values))
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr


TRIGGER = "decode.autoscaling.keda.extraTriggers[0]"


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (["decode.autoscaling.keda.minReplicaCount=-1"], "minReplicaCount"),
        (["decode.autoscaling.keda.threshold=0"], "threshold"),
        (["decode.autoscaling.keda.serverAddress=prometheus:9090"], "serverAddress"),
        ([f"{TRIGGER}.type=cron", f"{TRIGGER}.metadata.desiredReplicas=1"], "desiredReplicas"),
        (["router.autoscaling.keda.enabled=true"], "keda"),  # workers only
    ],
)  # fmt: skip
def test_schema_rejects_bad_keda_values(tools: Tools, values: list[str], needle: str) -> None:
    result = helm_template(tools.helm4, _set(*values))
    assert result.returncode != 0
    assert "schema" in result.stderr.lower() and needle in result.stderr, result.stderr
