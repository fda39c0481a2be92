"""Autoscaling: an HPA for every role that owns its replicas; workers scale on queue depth."""

from __future__ import annotations

from chart import LINUX_AMD64_ONLY, RELEASE, ROLES, Doc, deployment, of_kind

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
