"""`pagedserve gateway`: uvicorn (one process, one asyncio loop) serving the gateway's app.

Prints `READY gateway http://HOST:PORT` once it accepts connections (what `pagedserve up` and the
tests wait for). SIGTERM / SIGINT stop it gracefully: no new connections, in-flight requests
get `--drain-timeout` seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

import uvicorn

from pagedserve.gateway.app import GatewaySettings, create_app
from pagedserve.grpcutil import client_tls_from_args
from pagedserve.logs import setup_logging
from pagedserve.telemetry import setup_tracing

log = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    if bool(args.https_cert) != bool(args.https_key):
        print("--https-cert and --https-key: give both or neither", file=sys.stderr)
        return 2
    tracing = setup_tracing(
        "pagedserve-gateway", args.otlp_traces_endpoint, protocol=args.otlp_traces_protocol
    )
    settings = GatewaySettings(
        router=args.router,
        tls=client_tls_from_args(args),
        tracing=tracing,
        max_message_bytes=args.max_message_bytes,
        request_timeout_s=args.request_timeout,
        metrics_names=args.metrics_names,
    )
    sock = listening_socket(args.host, args.port)
    config = uvicorn.Config(
        create_app(settings),
        loop="asyncio",
        http="h11",
        lifespan="on",
        # NOTE: uvicorn's own records through our handler (--log-format), warnings and worse
        log_config=None,
        log_level=max(logging.WARNING, logging.getLevelName(args.log_level.upper())),
        access_log=False,
        timeout_graceful_shutdown=int(args.drain_timeout),
        ssl_certfile=args.https_cert,
        ssl_keyfile=args.https_key,
    )
    server = uvicorn.Server(config)
    scheme = "https" if args.https_cert else "http"
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"{scheme}://{host}:{sock.getsockname()[1]}"
    try:
        asyncio.run(_serve(server, sock, url))
    finally:
        tracing.shutdown()
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (bound here so that `--port 0` can be reported).

    NOTE: proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted
    sockets whose proto says TCP, and accepted sockets copy the listener's. With Nagle on, an
    SSE chunk written right after the response headers waited ~40 ms for the client's delayed
    ACK (measured: 72 ms → 140 ms for a 16-token stream).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket, url: str) -> None:
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        log.info("gateway serving at %s", url)
        print(f"READY gateway {url}", flush=True)
    await serving
