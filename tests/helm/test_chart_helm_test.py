"""`helm test <release>`: a Pod (hook `test`) that asks the router's health and generates a few
tokens through the router's Service, as a client does. Its command line is parsed by the real
CLI, its TLS and API-key files are traced to the release's Secrets, and the rendered command is
run against a real cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from chart import (
    LINUX_AMD64_ONLY,
    RELEASE,
    TLS_CASES,
    TLS_FLAG_KEYS,
    Doc,
    Tools,
    _set,
    flag,
    helm_template,
    mounted_file,
    of_kind,
    server_name,
)

from pagedserve.cli import build_parser

pytestmark = LINUX_AMD64_ONLY

TEST_POD = f"{RELEASE}-pagedserve-test"
ROUTER = f"{RELEASE}-pagedserve-router:50051"


def hook_pod(docs: list[Doc]) -> tuple[Doc, Doc]:
    """(pod spec, its one container) of the release's test hook."""
    (pod,) = [p for p in of_kind(docs, "Pod") if p["metadata"]["name"] == TEST_POD]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (box,) = pod["spec"]["containers"]
    return pod["spec"], box


@pytest.mark.parametrize("case", ["defaults", *TLS_CASES])
def test_hook_checks_health_then_generates_through_the_router_service(
    renders: dict[str, list[Doc]], case: str
) -> None:
    pod, box = hook_pod(renders[case])
    assert pod["restartPolicy"] == "Never"
    assert box["command"][:2] == ["python", "-c"]
    script = box["command"][2]
    assert 'service="pagedserve.v1.Generation"' in script and "HealthStub" in script
    args = build_parser().parse_args(["generate", *box["args"]])  # the CLI takes them
    assert (args.router, args.max_tokens, args.ignore_eos) == (ROUTER, 4, True)
    assert box["image"].endswith("-slim")  # the router's torch-free image has the CLI client
    for option, key in TLS_FLAG_KEYS.items():
        if option in box["args"]:
            assert case in TLS_CASES
            path = flag(box["args"], option) or ""
            secret = "corp-tls" if case == "tls-secret-fetch-model" else f"{RELEASE}-pagedserve-tls"
            assert mounted_file(pod, box, path) == ("secret", secret, key)
    if case in TLS_CASES:
        assert args.tls_server_name == server_name(case)
        # the client certificate where the router may ask for one (mtls on)
        assert (args.tls_client_cert is not None) == (case != "tls-secret-fetch-model")
    env = {e["name"]: e.get("value") for e in box.get("env", [])}
    if case == "production":  # created API keys: the hook reads the first one
        assert mounted_file(pod, box, env["PAGEDSERVE_API_KEY_FILE"]) == (
            "secret", f"{RELEASE}-pagedserve-api-keys", "api-keys")  # fmt: skip
    if case == "defaults":
        assert "env" not in box and "--tls-ca" not in box["args"]


def test_hook_is_let_through_a_restricted_network_policy(renders: dict[str, list[Doc]]) -> None:
    docs = renders["gateway-ingress-restricted"]
    (policy,) = [
        p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-router")
    ]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])]
    (pod,) = [p for p in of_kind(docs, "Pod") if p["metadata"]["name"] == TEST_POD]
    labels = pod["metadata"]["labels"]
    allowed = [p["podSelector"]["matchLabels"] for p in peers if "podSelector" in p]
    assert any(m and m.items() <= labels.items() for m in allowed), allowed


def test_hook_can_be_turned_off(tools: Tools) -> None:
    result = helm_template(tools.helm4, _set("tests.enabled=false"))
    assert result.returncode == 0, result.stderr
    assert "helm.sh/hook: test" not in result.stdout


def run_hook(box: Doc, router: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The rendered command, here: this Python, and the given router address."""
    argv = [sys.executable, *box["command"][1:], *box["args"]]
    argv[argv.index(ROUTER)] = router
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_rendered_hook_passes_on_a_real_cluster_and_fails_without_one(
    renders: dict[str, list[Doc]], clusters, tiny_llama: Path, tmp_path: Path
) -> None:
    _, box = hook_pod(renders["defaults"])
    cluster = clusters.get(tiny_llama, http_port=0)
    ok = run_hook(box, cluster.router_address, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("router health: SERVING")
    assert "4 generated]" in ok.stdout
    down = run_hook(box, "127.0.0.1:1", tmp_path)  # nothing listens: the hook fails, saying why
    assert down.returncode == 1 and "router health: UNAVAILABLE" in down.stderr
