"""`--health-port`: a plaintext port with grpc.health.v1.Health alone, for kubelet's gRPC probes
while the service port speaks only TLS (the Helm chart's probes under tls.enabled). It reports
what the TLS port reports, and nothing else is reachable on it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.certs import make_certs

from pagedserve.grpcutil import LoopThread, build_server, health_address, make_channel
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(port: int, service: str = "") -> int:
    """The status of `service` asked in plaintext on 127.0.0.1:`port` (grpc.RpcError if none)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_port_follows_readiness_of_a_tls_server(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    loop = LoopThread("health-port")
    handle = loop.run(
        build_server([], ["pagedserve.internal.v1.PrefillWorker"], tls=certs.server_tls(mtls=True))
    )
    loop.run(handle.add_health_port(health_address("127.0.0.1", 0)))
    assert handle.health_port
    loop.run(handle.start())
    try:
        assert check(handle.health_port) == SERVING  # alive while the model loads
        assert check(handle.health_port, "pagedserve.internal.v1.PrefillWorker") == NOT_SERVING
        loop.run(handle.set_ready(True))
        assert check(handle.health_port, "pagedserve.internal.v1.PrefillWorker") == SERVING
        with pytest.raises(grpc.RpcError) as plaintext_on_tls:
            check(handle.port)  # the service port speaks only TLS
        assert plaintext_on_tls.value.code() is grpc.StatusCode.UNAVAILABLE
        loop.run(handle.set_ready(False))  # draining
        assert check(handle.health_port, "pagedserve.internal.v1.PrefillWorker") == NOT_SERVING
    finally:
        loop.run(handle.stop(0))
        loop.close()
    with pytest.raises(grpc.RpcError):
        check(handle.health_port)  # stopped with the server


def test_router_process_answers_health_in_plaintext_and_nothing_else(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A real `pagedserve router` with mTLS on its API: the kubelet's view (plaintext Health on
    --health-port) works, plaintext on the API port does not, and the health port serves no
    Generation. No worker exists, so Generation is NOT_SERVING (the router's readiness)."""
    certs = make_certs(tmp_path)
    port, health = free_port(), free_port()
    command = [
        sys.executable, "-m", "pagedserve.cli", "router", "--model", str(tiny_llama),
        "--host", "127.0.0.1", "--port", str(port), "--health-port", str(health),
        "--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key),
        "--tls-client-ca", str(certs.ca),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp_path)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY router"):
                break
        assert proc.poll() is None, "".join(lines)
        assert check(health) == SERVING
        assert check(health, "pagedserve.v1.Generation") == NOT_SERVING
        with pytest.raises(grpc.RpcError) as plaintext_api:
            check(port)
        assert plaintext_api.value.code() is grpc.StatusCode.UNAVAILABLE
        # over mTLS the API port reports the same status
        with make_channel(f"127.0.0.1:{port}", certs.client_tls(), aio=False) as channel:
            request = health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation")
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        assert reply.status == NOT_SERVING
        with grpc.insecure_channel(f"127.0.0.1:{health}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as other:
                stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
        assert other.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        proc.terminate()
        proc.wait(timeout=30)
