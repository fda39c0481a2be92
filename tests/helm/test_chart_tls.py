"""TLS and API keys (issue 20): every file a flag names is traced to the volume and Secret key
that holds it, each role gets its TLS flags, cert-manager's Certificate names every Service, the
probes' plaintext health port stays out of Services and NetworkPolicies, and API keys reach the
router only."""

from __future__ import annotations

import base64
import os
import subprocess

import pytest
from chart import (
    API_KEYS,
    CHART,
    GATEWAY,
    HEALTH_PORT,
    LINUX_AMD64_ONLY,
    NAMESPACE,
    PROBES,
    PRODUCTION,
    RELEASE,
    ROLES,
    SERVER_NAME,
    TLS_CASES,
    TLS_DIR,
    TLS_FLAG_KEYS,
    TLS_SECRET,
    Doc,
    Tools,
    _set,
    chart_containers,
    container,
    deployment,
    flag,
    mounted_file,
    of_kind,
    render,
    server_name,
)

from pagedserve.router.auth import ApiKeys

pytestmark = LINUX_AMD64_ONLY


def command_lines(box: Doc) -> list[list[str]]:
    """The container's args (the only command lines: no exec probes)."""
    assert not [p for p in PROBES if "exec" in box.get(p, {})]
    return [box.get("args", [])]


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
    for role in (*ROLES, "gateway"):
        assert not [a for a in container(renders["defaults"], role)["args"] if "tls" in a]


@pytest.mark.parametrize("case", TLS_CASES)
def test_health_port_is_for_kubelet_only(renders: dict[str, list[Doc]], case: str) -> None:
    """The plaintext health port is in no Service, and the NetworkPolicies open only the TLS
    ports (and metrics) to pods: kubelet reaches it from the node, which NetworkPolicy always
    lets in; another pod cannot even learn a health status over plaintext."""
    docs = renders[case]
    for service in of_kind(docs, "Service"):
        targets = {p.get("targetPort") for p in service["spec"]["ports"]}
        assert "health" not in targets and HEALTH_PORT not in targets
        assert HEALTH_PORT not in {p["port"] for p in service["spec"]["ports"]}
    for policy in of_kind(docs, "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            assert HEALTH_PORT not in {p["port"] for p in rule["ports"]}
    for role in ROLES:
        box = container(docs, role)
        assert {p["grpc"]["port"] for p in (box[probe] for probe in PROBES)} == {HEALTH_PORT}


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
