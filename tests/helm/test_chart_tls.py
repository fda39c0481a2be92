"""TLS and API keys (issue 20): every file a flag names is traced to the volume and Secret key
that holds it, each role gets its TLS flags, cert-manager's Certificate names every Service, the
TLS exec probe is run against a real TLS server, and API keys reach the router only."""

from __future__ import annotations

import base64
import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chart import (
    API_KEYS,
    CHART,
    GATEWAY,
    LINUX_AMD64_ONLY,
    NAMESPACE,
    PROBE_SCRIPT,
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
    probe_args,
    render,
    server_name,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagedserve.grpcutil import LoopThread, ServerTLS, build_server
from pagedserve.router.auth import ApiKeys

pytestmark = LINUX_AMD64_ONLY


def command_lines(box: Doc) -> list[list[str]]:
    """The container's args and its exec probes' commands."""
    return [box.get("args", [])] + [
        box[p]["exec"]["command"] for p in PROBES if "exec" in box.get(p, {})
    ]


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
