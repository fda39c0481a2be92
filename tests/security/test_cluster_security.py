"""A whole cluster with mTLS on every link and per-tenant API keys on the public API, started
by `start_cluster` (the code of `pagedserve up`) and driven over the real gRPC API."""

from __future__ import annotations

import argparse
import itertools

import grpc
import pytest
from certs import make_certs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from oracle import make_prompts

from pagedserve.grpcutil import ClientTLS, make_channel
from pagedserve.launcher import start_cluster
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef00"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
_ids = itertools.count()


@pytest.fixture(scope="module")
def cluster(make_tiny, tmp_path_factory):
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# tenant:key\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    args = argparse.Namespace(
        model=str(make_tiny("llama")), host="127.0.0.1", port=0, prefill=1, decode=1,
        redis_url=None, block_size=16, dtype=None, kv_cache_memory="16MiB",
        start_timeout=120.0, log_dir=None, api_key_file=str(key_file),
        tls_cert=str(certs.server.cert), tls_key=str(certs.server.key),
        tls_client_ca=str(certs.ca), tls_ca=str(certs.ca),
        tls_client_cert=str(certs.client.cert), tls_client_key=str(certs.client.key),
    )  # fmt: skip
    started = start_cluster(args, tmp_path_factory.mktemp("cluster-logs"))
    channel = make_channel(started.router_address, certs.client_tls("client"))
    yield started, certs, generation_pb2_grpc.GenerationStub(channel)
    channel.close()
    started.stop()
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
    for child in [*workers, started.children[0]]:
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
