"""grpc.health.v1 check over TLS, for the chart's exec probes (kubelet's gRPC probes speak only
plaintext). Exit status 0 when the service answers SERVING, 1 otherwise (NOT_SERVING, refused,
handshake failure, timeout), with one line on stderr saying why.

    python grpc_health_probe.py --port 50061 --service pagedserve.v1.PrefillWorker \
        --tls-ca ca.crt --tls-server-name NAME [--tls-client-cert tls.crt --tls-client-key tls.key]

The flags are named like the servers' outgoing-channel flags and dial as they do (the CA, the
name override and, under mTLS, the client certificate). It imports only grpcio and the health
stubs (both in the image), so a probe costs a Python start and a TLS handshake.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grpc_health_probe")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help='"" = alive, a full name = ready')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", required=True)
    parser.add_argument("--tls-server-name", default=None)
    parser.add_argument("--tls-client-cert", default=None)
    parser.add_argument("--tls-client-key", default=None)
    return parser.parse_args(argv)


def check(args: argparse.Namespace) -> str:
    """The serving status name of `args.service` (grpc.RpcError when the call fails)."""
    cert = Path(args.tls_client_cert).read_bytes() if args.tls_client_cert else None
    key = Path(args.tls_client_key).read_bytes() if args.tls_client_key else None
    credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes(), key, cert)
    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    with grpc.secure_channel(f"{args.host}:{args.port}", credentials, options) as channel:
        request = health_pb2.HealthCheckRequest(service=args.service)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        status = check(args)
    except grpc.RpcError as err:
        print(f"health {args.service!r}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"health {args.service!r}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
