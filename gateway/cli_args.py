"""`pagedserve gateway`'s flags, apart from the server so that building the command line (every
worker does, at start-up) does not import FastAPI and uvicorn."""

from __future__ import annotations

import argparse

from pagedserve.cli_options import (
    add_client_tls_arguments,
    add_metrics_names_argument,
    add_serving_arguments,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="host:port of the router's gRPC API")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in pods)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    parser.add_argument(
        "--request-timeout", type=float, default=None,
        help="seconds a completion may take before it is cancelled (default: no limit)",
    )  # fmt: skip
    add_serving_arguments(parser)
    add_metrics_names_argument(parser)  # NOTE: its /metrics is on --port
    group = parser.add_argument_group("TLS")
    group.add_argument("--https-cert", default=None, help="serve HTTPS with this certificate")
    group.add_argument("--https-key", default=None, help="its private key")
    add_client_tls_arguments(group)  # NOTE: to the router
