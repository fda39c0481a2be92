"""A whole cluster with mTLS on every link and per-tenant API keys on the public API, started
by `start_cluster` (the code of `pagedserve up`) and driven over the real gRPC API."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.certs import make_certs
from support.oracle import make_prompts

from pagedserve.grpcutil import ClientTLS, make_channel
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef00"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
_ids = itertools.count()


@pytest.fixture(scope="module")
def cluster(make_tiny, tmp_path_factory, clusters):
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# tenant:key\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    flags = dict(
        api_key_file=str(key_file), tls_cert=str(certs.server.cert),
        tls_key=str(certs.server.key), tls_client_ca=str(certs.ca), tls_ca=str(certs.ca),
        tls_client_cert=str(certs.client.cert), tls_client_key=str(certs.client.key),
        http_port=0,
    )  # fmt: skip
    with clusters.private(make_tiny("llama"), **flags) as started:
        channel = make_channel(started.router_address, certs.client_tls("client"))
        yield started, certs, generation_pb2_grpc.GenerationStub(channel)
        channel.close()
    logs = "".join(c.log_path.read_text() for c in started.children)
    assert not any(key in logs for key in KEYS.values()), "an API key reached a log"


def auth(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def request(prompt, params=GREEDY, **fields) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(sampling=sampling_to_proto(params), stream=True, **fields)
    msg.token_ids.ids.extend(prompt)
    return msg


def error_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_missing_or_wrong_api_key_is_unauthenticated(cluster):
    _, _, stub = cluster
    prompt = make_prompts((8,), seed=71)[0]
    for metadata in ([], [("authorization", "Bearer not-a-key")], [("authorization", "x")]):
        err = error_of(lambda m=metadata: list(stub.Generate(request(prompt), metadata=m)))
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "key" in err.details() and "not-a-key" not in err.details()
    err = error_of(lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"), timeout=5))
    assert err.code() is grpc.StatusCode.UNAUTHENTICATED
    tokens = stub.Tokenize(generation_pb2.TokenizeRequest(text="hi"), metadata=auth("bob"))
    assert list(tokens.token_ids)


def test_workers_refuse_clients_without_the_cluster_certificate(cluster):
    started, certs, _ = cluster
    workers = [c for c in started.children if c.name.startswith(("prefill", "decode"))]
    router = next(c for c in started.children if c.name == "router")
    for child in [*workers, router]:
        service = "" if child.name != "router" else "pagedserve.v1.Generation"
        probe = health_pb2.HealthCheckRequest(service=service)
        for tls in (certs.client_tls("none"), certs.client_tls("rogue"), None):
            with make_channel(child.address, tls) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                err = error_of(lambda s=stub, p=probe: s.Check(p, timeout=3))
                assert err.code() is grpc.StatusCode.UNAVAILABLE, child.name
        with make_channel(child.address, certs.client_tls("client")) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(probe, timeout=3).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_tenant_cannot_abort_another_tenants_request(cluster):
    _, _, stub = cluster
    request_id = f"bob-{next(_ids)}"
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = stub.Generate(
        request(make_prompts((20,), seed=72)[0], long, request_id=request_id),
        metadata=auth("bob"),
        timeout=60,
    )
    assert next(stream).request_id == request_id  # running now
    abort = common_pb2.AbortRequest(request_id=request_id)
    assert not stub.Abort(abort, metadata=auth("alice"), timeout=5).found
    assert stub.Abort(abort, metadata=auth("bob"), timeout=5).found
    parts = list(stream)
    assert parts[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(p.token_ids) for p in parts) < 399


def cached_tokens(stub, tenant: str, prompt: list[int], salt: str = "") -> int:
    parts = list(stub.Generate(request(prompt, cache_salt=salt), metadata=auth(tenant), timeout=60))
    assert parts[-1].finish_reason in (
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_STOP,
    )
    return parts[-1].usage.cached_prompt_tokens


def test_tenants_never_share_prefix_cache_blocks(cluster):
    _, _, stub = cluster
    prompt = make_prompts((48,), seed=73)[0] + [5]
    assert cached_tokens(stub, "alice", prompt) == 0
    assert cached_tokens(stub, "alice", prompt) == 48  # the cache works for one tenant...
    assert cached_tokens(stub, "bob", prompt) == 0  # ...but never across tenants
    assert cached_tokens(stub, "bob", prompt, salt="alice") == 0  # a salt cannot forge a tenant
    assert cached_tokens(stub, "bob", prompt) == 48


def test_client_tls_without_a_ca_uses_the_system_roots_and_refuses_the_test_ca(cluster):
    started, _, _ = cluster
    with make_channel(started.router_address, ClientTLS()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        err = error_of(lambda: stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=3))
        assert err.code() is grpc.StatusCode.UNAVAILABLE


def greedy_tokens(stub, tenant: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    parts = list(stub.Generate(request(prompt, params), metadata=auth(tenant), timeout=60))
    return [t for p in parts for t in p.token_ids]


def test_tenants_may_run_the_same_request_id_and_abort_only_their_own(cluster):
    _, _, stub = cluster
    prompt_a, prompt_b = make_prompts((20, 20), seed=74)
    want_a, want_b = (
        greedy_tokens(stub, "alice", prompt_a, 24),
        greedy_tokens(stub, "bob", prompt_b, 24),
    )
    shared = f"shared-{next(_ids)}"
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def start(tenant: str, prompt: list[int]):
        stream = stub.Generate(
            request(prompt, long, request_id=shared), metadata=auth(tenant), timeout=60
        )
        return stream, next(stream)

    stream_a, first_a = start("alice", prompt_a)  # running now
    again = error_of(lambda: start("alice", prompt_b))  # alice's own id: still one at a time
    assert again.code() is grpc.StatusCode.ALREADY_EXISTS and "already running" in again.details()
    stream_b, first_b = start("bob", prompt_b)  # the same id for another tenant: no collision
    assert stub.Abort(common_pb2.AbortRequest(request_id=shared), metadata=auth("alice")).found
    parts_a, parts_b = [first_a, *stream_a], [first_b, *stream_b]
    assert parts_a[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    tokens_a = [t for p in parts_a for t in p.token_ids]
    assert len(tokens_a) < 399 and tokens_a[:24] == want_a[: len(tokens_a)]
    assert parts_b[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # bob's ran to the end
    tokens_b = [t for p in parts_b for t in p.token_ids]
    assert len(tokens_b) == 400 and tokens_b[:24] == want_b
    assert {p.request_id for p in parts_a + parts_b} == {shared}  # never the worker-side id


# ---- the client commands, run as real processes ------------------------------------------


def pagedserve(*argv: str, env_key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_API_KEY")}
    if env_key is not None:
        env["PAGEDSERVE_API_KEY"] = env_key
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *argv],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def tls_flags(certs, which: str = "client") -> list[str]:
    """`which`: "client" (the cluster's cert), "rogue" (another CA's), "none" (CA only)."""
    pem = {"client": certs.client, "rogue": certs.rogue_client, "none": None}[which]
    flags = ["--tls-ca", str(certs.ca)]
    return flags if pem is None else [*flags, "--tls-client-cert", str(pem.cert),
                                      "--tls-client-key", str(pem.key)]  # fmt: skip


def run_all(*commands: tuple[list[str], str | None]) -> list[subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda c: pagedserve(*c[0], env_key=c[1]), commands))


def test_cli_generate_and_status_work_with_the_cluster_certificate_and_a_key(cluster):
    started, certs, _ = cluster
    router = ["--router", started.router_address, *tls_flags(certs)]
    generated, status = run_all(
        (["generate", "--prompt", "The oven", "--max-tokens", "4", *router,
          "--api-key", KEYS["alice"]], None),
        (["status", *router], KEYS["bob"]),  # the key from $PAGEDSERVE_API_KEY
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    assert "prompt tokens" in generated.stdout and "generated]" in generated.stdout
    assert status.returncode == 0, status.stderr
    assert "prefill" in status.stdout and "decode" in status.stdout
    for out in (generated, status):
        assert not any(key in out.stdout + out.stderr for key in KEYS.values())


def test_cli_without_the_key_or_the_certificate_fails_in_one_line(cluster):
    started, certs, _ = cluster
    address = ["--router", started.router_address]
    generate = ["generate", "--prompt", "The oven", "--max-tokens", "4", *address]
    cases = {
        "no key": ((generate + tls_flags(certs), None), "UNAUTHENTICATED"),
        "wrong key": ((["status", *address, *tls_flags(certs)], "not-a-key-0123456789"),
                      "UNAUTHENTICATED"),
        "no client certificate": ((generate + tls_flags(certs, "none"), KEYS["alice"]), "TLS"),
        "rogue certificate": ((["status", *address, *tls_flags(certs, "rogue")], KEYS["bob"]),
                              "TLS"),
        "plaintext": ((["status", *address, "--api-key", KEYS["bob"]], None), "TLS"),
    }  # fmt: skip
    results = run_all(*(command for command, _ in cases.values()))
    for (name, (_, expected)), out in zip(cases.items(), results, strict=True):
        assert out.returncode == 1, (name, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (name, out.stderr)
        assert "Traceback" not in out.stderr, name
        assert not any(key in out.stdout + out.stderr for key in KEYS.values()), name
        assert "not-a-key" not in out.stderr, name


def https(url: str, ca, body: dict, key: str | None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_the_gateway_serves_https_and_reaches_the_router_over_mtls(cluster):
    """`up --http-port` with the cluster certificate: HTTPS outside, mTLS to the router, the
    router's keys decide, and plaintext HTTP gets no answer."""
    started, certs, _ = cluster
    assert started.http_url.startswith("https://")
    url = f"{started.http_url}/v1/completions"
    body = {"model": "model", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    models = urllib.request.Request(f"{started.http_url}/v1/models")
    models.add_header("Authorization", f"Bearer {KEYS['alice']}")
    context = ssl.create_default_context(cafile=str(certs.ca))
    with urllib.request.urlopen(models, timeout=30, context=context) as response:
        body["model"] = json.load(response)["data"][0]["id"]
    status, answer = https(url, certs.ca, body, KEYS["alice"])
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    for key in ("not-a-key-0123456789abcdef", None):
        status, answer = https(url, certs.ca, body, key)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    plain = url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(urllib.request.Request(plain, data=b"{}"), timeout=10)
