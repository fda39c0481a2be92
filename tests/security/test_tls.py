"""TLS and mTLS on `build_server` and `make_channel`, with certificates made at test time."""

from __future__ import annotations

import argparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.aio_servers import serving
from support.certs import make_certs

from pagedserve.cli_options import add_server_arguments
from pagedserve.grpcutil import ClientTLS, build_server, make_channel, server_tls_from_args


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def serve(tls):
    return serving(build_server([], ["test.Service"], tls=tls))


def health(address: str, tls: ClientTLS | None) -> int:
    with make_channel(address, tls) as channel:
        request = health_pb2.HealthCheckRequest(service="test.Service")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=3).status


def handshake_fails(address: str, tls: ClientTLS | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        health(address, tls)
    return info.value.code()


@pytest.fixture(scope="module")
def mtls_server(certs):
    with serve(certs.server_tls(mtls=True)) as handle:
        yield f"127.0.0.1:{handle.port}"


def test_mtls_server_answers_a_client_with_the_cluster_certificate(certs, mtls_server):
    assert health(mtls_server, certs.client_tls("client")) == health_pb2.HealthCheckResponse.SERVING


def test_mtls_server_refuses_a_client_without_a_certificate(certs, mtls_server):
    assert handshake_fails(mtls_server, certs.client_tls("none")) is grpc.StatusCode.UNAVAILABLE


def test_mtls_server_refuses_a_certificate_from_another_ca(certs, mtls_server):
    assert handshake_fails(mtls_server, certs.client_tls("rogue")) is grpc.StatusCode.UNAVAILABLE


def test_tls_server_refuses_plaintext(certs, mtls_server):
    assert handshake_fails(mtls_server, None) is grpc.StatusCode.UNAVAILABLE


def test_client_refuses_a_server_its_ca_did_not_sign(certs, tmp_path):
    other = make_certs(tmp_path)  # a different CA: the server's certificate is not trusted
    with serve(certs.server_tls(mtls=False)) as handle:
        address = f"127.0.0.1:{handle.port}"
        assert health(address, certs.client_tls("none")) == health_pb2.HealthCheckResponse.SERVING
        assert handshake_fails(address, other.client_tls("none")) is grpc.StatusCode.UNAVAILABLE


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, default_port=0)
    return parser.parse_args(list(argv))


def test_tls_flags_must_come_in_pairs(certs):
    assert server_tls_from_args(parse()) is None
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        server_tls_from_args(parse("--tls-cert", str(certs.server.cert)))
    with pytest.raises(ValueError, match="--tls-client-ca"):
        server_tls_from_args(parse("--tls-client-ca", str(certs.ca)))
    tls = server_tls_from_args(
        parse("--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key),
              "--tls-client-ca", str(certs.ca))
    )  # fmt: skip
    assert tls is not None and tls.client_ca == certs.ca.read_bytes()
    assert "PRIVATE KEY" not in repr(tls)
