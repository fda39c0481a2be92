"""The pods: gRPC health probes, drain and termination grace, pod IPs, torch threads, /dev/shm,
hardening (security contexts) and scheduling."""

from __future__ import annotations

import pytest
from chart import (
    HEALTH_PORT,
    LINUX_AMD64_ONLY,
    MATRIX,
    PROBES,
    ROLES,
    TLS_CASES,
    Doc,
    Tools,
    _set,
    container,
    deployment,
    flag,
    of_kind,
    render,
)

pytestmark = LINUX_AMD64_ONLY


def pod_specs(docs: list[Doc]) -> list[tuple[str, Doc]]:
    return [
        (doc["metadata"]["name"], doc["spec"]["template"]["spec"])
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
    ]


@pytest.mark.parametrize("case", list(MATRIX))
def test_probes_hit_the_grpc_health_service(renders: dict[str, list[Doc]], case: str) -> None:
    """Kubelet's native gRPC probes everywhere, no exec probe (no Python start per probe): on the
    service port, or under TLS (which kubelet's probes cannot speak) on `--health-port`, the
    plaintext Health-only port (tests/security/test_health_port.py runs it)."""
    for role, (service, port) in ROLES.items():
        box = container(renders[case], role)
        ports = {p["name"]: p["containerPort"] for p in box["ports"]}
        assert ports["grpc"] == port
        assert flag(box["args"], "--port") == str(port)
        assert flag(box["args"], "--host") == "0.0.0.0"
        tls = case in TLS_CASES
        assert flag(box["args"], "--health-port") == (str(HEALTH_PORT) if tls else None)
        assert ports.get("health") == (HEALTH_PORT if tls else None)
        for probe, asked in (("readinessProbe", service), ("livenessProbe", ""),
                             ("startupProbe", "")):  # fmt: skip
            assert "exec" not in box[probe]
            assert box[probe]["grpc"] == {"port": HEALTH_PORT if tls else port, "service": asked}
    for _, pod in pod_specs(renders[case]):  # Redis's `redis-cli ping` is the one exec probe
        for box in pod["containers"]:
            commands = [box[p]["exec"]["command"] for p in PROBES if "exec" in box.get(p, {})]
            assert not [c for c in commands if "python" in c[0]], box["name"]
            assert not commands or box["name"] == "redis"


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
