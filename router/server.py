"""`pagedserve router`: the public gRPC face of a cluster (never imports torch).

Start-up: read the tokenizer and config, connect Redis if given (a failure is not fatal: the
router starts degraded and recovers), bind, poll worker loads, mark ready when at least one
prefill and one decode worker answer, print `READY router <address>`. SIGTERM: NOT_SERVING,
in-flight streams get `--drain-timeout` to finish, then stop.

It serves on one asyncio event loop (`grpc.aio`, DESIGN §3.8): every stream is a coroutine,
so streams cost no threads, every waiting request is in the router's own table (admission
control sees it), and health checks never wait behind generation. Blocking work (tokenizing,
Redis lookups) runs on the loop's default executor, a bounded pool.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from dataclasses import dataclass

from pagedserve.cli_options import quantization_name
from pagedserve.grpcutil import (
    ServerHandle,
    ServerTLS,
    build_server,
    client_tls_from_args,
    server_tls_from_args,
)
from pagedserve.kvstore.hashing import model_fingerprint
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, compat_tag, connect
from pagedserve.metrics import CounterSource, Gauge, RequestMetrics, register_state
from pagedserve.router.auth import ApiKeys, AuthInterceptor, load_api_keys
from pagedserve.router.cli_args import add_arguments
from pagedserve.router.routing import DEFAULT_LOCAL_PREFILL, LocalPrefill, RoutingPolicy, WorkerSet
from pagedserve.router.servicer import GenerationServicer, RouterSettings
from pagedserve.router.tokenizer import RouterTokenizer, read_model_card
from pagedserve.sampling_params import DEFAULT_MAX_N
from pagedserve.signals import stop_on_signals
from pagedserve.telemetry import setup_tracing, start_metrics_server
from pagedserve.v1 import generation_pb2_grpc

log = logging.getLogger("pagedserve.router")
SERVICE_NAME = "pagedserve.v1.Generation"


def build_servicer(
    args: argparse.Namespace, metrics: RequestMetrics | None = None
) -> tuple[GenerationServicer, WorkerSet]:
    """The router's servicer and worker set (on the event loop that will serve them: the
    worker channels are asyncio channels). `metrics` None: a private registry (tests)."""
    card = read_model_card(
        args.model,
        args.served_model_name,
        max_model_len=getattr(args, "max_model_len", None),
        use_generation_config=getattr(args, "generation_config", "auto") != "none",
    )
    tokenizer = RouterTokenizer.from_model_dir(args.model)
    registry = index = None
    if args.redis_url:
        client = connect(args.redis_url)
        registry = WorkerRegistry(client, card.name)
        # NOTE: its own client with a short timeout: a lookup is on every request's path
        lookup_client = connect(args.redis_url, timeout_s=getattr(args, "index_timeout", 0.04))
        index = RedisPrefixIndex(lookup_client, card.name, block_size=args.block_size)
    fingerprint = model_fingerprint(
        card.config, dtype=args.dtype or card.dtype, revision=args.revision,
        weights=quantization_name(
            getattr(args, "quantization", None), getattr(args, "quantization_group_size", 32)
        ),
    )  # fmt: skip
    workers = WorkerSet(
        args.prefill,
        args.decode,
        registry,
        max_message_bytes=args.max_message_bytes,
        tls=client_tls_from_args(args),
        compat=compat_tag(fingerprint, args.block_size),
    )
    policy = RoutingPolicy(
        workers,
        index,
        block_size=args.block_size,
        local_prefill=LocalPrefill(
            getattr(args, "max_local_prefill_tokens", DEFAULT_LOCAL_PREFILL.max_tokens),
            getattr(args, "local_prefill_queue_tokens", DEFAULT_LOCAL_PREFILL.queue_tokens),
        ),
    )
    tracing = setup_tracing(
        "pagedserve-router",
        getattr(args, "otlp_traces_endpoint", None),
        include_text=getattr(args, "trace_include_text", False),
    )
    settings = RouterSettings(
        block_size=args.block_size,
        model_fingerprint=fingerprint,
        max_queued_requests=args.max_queued_requests,
        route_wait_s=getattr(args, "route_wait_timeout", 5.0),
        stream_interval=getattr(args, "stream_interval", 1),
        max_n=getattr(args, "max_n", DEFAULT_MAX_N),
        stall_timeout_s=getattr(args, "stall_timeout", 10.0),
        max_migrations=getattr(args, "max_migrations", 2),
        decode_delivery=getattr(args, "decode_delivery", True),
    )
    servicer = GenerationServicer(
        tokenizer, card, workers, policy, settings, tracing=tracing, metrics=metrics
    )
    return servicer, workers


@dataclass(slots=True)
class RunningRouter:
    """A router serving on the current event loop: its servicer, worker set, server, poller."""

    servicer: GenerationServicer
    workers: WorkerSet
    handle: ServerHandle
    poll_interval_s: float
    ready: bool = False
    poller: asyncio.Task | None = None

    async def refresh(self) -> None:
        """One round of the load poller: membership and load, then readiness."""
        await self.workers.refresh()
        healthy = {w.role for w in self.workers.workers() if w.healthy}
        ready = {Role.PREFILL, Role.DECODE} <= healthy
        if ready != self.ready:
            await self.handle.set_ready(ready)
            self.ready = ready
            log.info("ready: %s", ready)

    async def poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # NOTE: a bug here must not stop routing updates for good
                log.exception("load poll failed")
            await asyncio.sleep(self.poll_interval_s if self.ready else 0.1)

    async def stop(self, grace_s: float | None) -> None:
        """NOT_SERVING, streams get `grace_s` to finish, then everything stops."""
        await self.handle.set_ready(False)
        if self.poller is not None:
            self.poller.cancel()
        await self.handle.server.stop(grace_s)
        await self.servicer.orchestrator.clients.close()
        await self.workers.close()
        self.servicer.tracing.shutdown()


async def start_router(
    args: argparse.Namespace,
    metrics: RequestMetrics | None = None,
    *,
    keys: ApiKeys | None = None,
    tls: ServerTLS | None = None,
) -> RunningRouter:
    """Build the router of `args`, bind and start its server and its load poller, on the
    running event loop; ready (health SERVING) once a prefill and a decode worker answer."""
    servicer, workers = build_servicer(args, metrics)
    handle = await build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        address=f"{args.host}:{args.port}",
        max_message_bytes=args.max_message_bytes,
        interceptors=[AuthInterceptor(keys)] if keys is not None else [],
        tls=tls,
    )
    await handle.server.start()
    router = RunningRouter(servicer, workers, handle, args.load_poll_interval)
    await router.refresh()
    router.poller = asyncio.create_task(router.poll_forever(), name="load-poller")
    return router


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    stop_on_signals(stop)
    return asyncio.run(_serve(args, stop))


async def _serve(args: argparse.Namespace, stop: threading.Event) -> int:
    keys = load_api_keys(getattr(args, "api_key_file", None))  # NOTE: read at start, not import
    tls = server_tls_from_args(args)
    router = await start_router(args, RequestMetrics(), keys=keys, tls=tls)
    _register_state_metrics(router.servicer)
    metrics_port = start_metrics_server(args.metrics_port, args.host)
    address = args.advertise_address or f"{args.host}:{router.handle.port}"
    if metrics_port is not None:
        log.info("metrics on :%d/metrics", metrics_port)
    log.info(
        "public API: %s, %s",
        "TLS" + (" (client certificates required)" if tls and tls.client_ca else "")
        if tls
        else "plaintext",
        f"API keys for {len(keys.tenants)} tenant(s)" if keys else "no API keys",
    )
    print(f"READY router {address}", flush=True)
    await asyncio.to_thread(stop.wait)
    await router.stop(args.drain_timeout)
    return 0


def _register_state_metrics(servicer: GenerationServicer) -> None:
    policy = servicer.policy
    index_stats = policy.index.stats if policy.index is not None else None
    register_state(
        [
            Gauge("index_degraded", "1 while routing ignores the prefix index.",
                  lambda: float(policy.index_degraded)),
            Gauge("num_requests_running", "Requests in flight through this router.",
                  lambda: float(servicer.num_active)),
        ],
        [
            CounterSource("prefix_index_", lambda: index_stats),
            CounterSource("routes_", lambda: policy.stats),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedserve router")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
