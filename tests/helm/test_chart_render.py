"""What the chart renders: the three roles, the gateway and Redis, names and labels, Services,
Redis bundled or external, the model volume and its download, warm-up prompts, extra volumes
and the NOTES."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from chart import (
    CHART,
    EXTERNAL_REDIS,
    GATEWAY,
    GATEWAY_PORT,
    LINUX_AMD64_ONLY,
    MATRIX,
    NAMESPACE,
    OTLP,
    RELEASE,
    ROLES,
    Doc,
    Tools,
    container,
    deployment,
    flag,
    kind_counts,
    mounted_file,
    of_kind,
)

from pagedserve.cli import build_parser

pytestmark = LINUX_AMD64_ONLY


def test_defaults_render_three_roles_a_gateway_and_a_bundled_redis(
    renders: dict[str, list[Doc]],
) -> None:
    assert kind_counts(renders["defaults"]) == {
        "Deployment": 4,
        "Service": 6,  # the router's headless one for the gateways
        "StatefulSet": 1,
        "PodDisruptionBudget": 4,
        "NetworkPolicy": 6,
        "ServiceAccount": 1,
        "Pod": 1,  # the `helm test` hook and its NetworkPolicy (test_chart_helm_test.py)
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
    assert len(of_kind(docs, "NetworkPolicy")) == 5  # no Redis one; the helm test pod's
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
