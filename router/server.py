"""`pagedserve router`: the public gRPC face of a cluster (never imports torch).

Start-up: read the tokenizer and config, connect Redis if given (a failure is not fatal: the
router starts degraded and recovers), bind, poll worker loads, mark ready when at least one
prefill and one decode worker answer, print `READY router <address>`. SIGTERM: NOT_SERVING,
in-flight streams get `--drain-timeout` to finish, then stop.

It serves on one asyncio event loop (`grpc.aio`, docs/architecture.md): every stream is a coroutine,
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

from pagedserve.cli_options import check_quantization, quantization_name
from pagedserve.grpcutil import (
    DEFAULT_MAX_PENDING_CALLS,
    ClientTLS,
    ServerHandle,
    ServerTLS,
    build_server,
    client_tls_from_args,
    health_address,
    server_tls_from_args,
)
from pagedserve.kvstore.hashing import model_fingerprint
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, compat_tag, connect
from pagedserve.logs import setup_logging
from pagedserve.metrics import CounterSource, Gauge, RequestMetrics, register_state
from pagedserve.router.auth import ApiKeys, AuthInterceptor, load_api_keys
from pagedserve.router.chat import read_template_file
from pagedserve.router.cli_args import add_arguments
from pagedserve.router.routing import LocalPrefill, RoutingPolicy, WorkerSet
from pagedserve.router.servicer import GenerationServicer, RouterSettings
from pagedserve.router.tokenizer import RouterTokenizer, read_model_card
from pagedserve.signals import stop_on_signals
from pagedserve.telemetry import setup_tracing, start_metrics_server
from pagedserve.v1 import generation_pb2_grpc

log = logging.getLogger("pagedserve.router")
SERVICE_NAME = "pagedserve.v1.Generation"


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """Everything `pagedserve router` takes from its flags, typed, built once (`from_args`);
    the defaults are the parser's (router/cli_args.py), written there only."""

    model: str
    served_model_name: str | None
    revision: str
    dtype: str | None
    weights: str  # quantized weights' name in block hashes (cli_options.quantization_name)
    block_size: int
    max_model_len: int | None
    use_generation_config: bool
    chat_template: str | None  # the source of --chat-template FILE (read, compiled), or None
    tool_call_parser: str  # --tool-call-parser: auto, none or one of chat.TOOL_CALL_PARSERS
    host: str
    port: int
    advertise_address: str | None
    static_prefill: list[str]
    static_decode: list[str]
    redis_url: str | None
    index_timeout_s: float
    max_message_bytes: int
    load_poll_interval_s: float
    drain_timeout_s: float
    metrics_port: int | None
    metrics_names: str  # --metrics-names
    otlp_traces_endpoint: str | None
    otlp_traces_protocol: str | None  # --otlp-traces-protocol (None: OTEL_* variables, else grpc)
    trace_include_text: bool
    api_key_file: str | None
    server_tls: ServerTLS | None
    client_tls: ClientTLS | None
    local_prefill: LocalPrefill
    max_queued_requests: int
    route_wait_s: float
    stream_interval: int
    max_n: int
    stall_timeout_s: float
    max_migrations: int
    decode_delivery: bool
    health_port: int | None = None  # --health-port: plaintext grpc.health.v1 only

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterOptions:
        """ValueError (or OSError reading a TLS file) naming the flag when they do not fit."""
        check_quantization(args.quantization, args.quantize_lm_head)
        return cls(
            model=args.model,
            served_model_name=args.served_model_name,
            revision=args.revision,
            dtype=args.dtype,
            weights=quantization_name(args.quantization, args.quantization_group_size),
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            use_generation_config=args.generation_config != "none",
            chat_template=read_template_file(args.chat_template) if args.chat_template else None,
            tool_call_parser=getattr(args, "tool_call_parser", "auto"),
            host=args.host,
            port=args.port,
            advertise_address=args.advertise_address,
            static_prefill=list(args.prefill),
            static_decode=list(args.decode),
            redis_url=args.redis_url,
            index_timeout_s=args.index_timeout,
            max_message_bytes=args.max_message_bytes,
            load_poll_interval_s=args.load_poll_interval,
            drain_timeout_s=args.drain_timeout,
            metrics_port=args.metrics_port,
            metrics_names=args.metrics_names,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            otlp_traces_protocol=args.otlp_traces_protocol,
            trace_include_text=args.trace_include_text,
            api_key_file=args.api_key_file,
            server_tls=server_tls_from_args(args),
            client_tls=client_tls_from_args(args),
            local_prefill=LocalPrefill(
                args.max_local_prefill_tokens,
                args.local_prefill_queue_tokens,
                args.max_local_suffix_tokens,
            ),
            max_queued_requests=args.max_queued_requests,
            route_wait_s=args.route_wait_timeout,
            stream_interval=args.stream_interval,
            max_n=args.max_n,
            stall_timeout_s=args.stall_timeout,
            max_migrations=args.max_migrations,
            decode_delivery=args.decode_delivery,
            health_port=args.health_port,
        )

    def settings(self, fingerprint: bytes) -> RouterSettings:
        """The orchestrator's settings, for a model of this block-hash `fingerprint`."""
        return RouterSettings(
            block_size=self.block_size,
            model_fingerprint=fingerprint,
            max_queued_requests=self.max_queued_requests,
            route_wait_s=self.route_wait_s,
            stream_interval=self.stream_interval,
            max_n=self.max_n,
            stall_timeout_s=self.stall_timeout_s,
            max_migrations=self.max_migrations,
            decode_delivery=self.decode_delivery,
        )


def build_servicer(
    options: RouterOptions, metrics: RequestMetrics | None = None
) -> tuple[GenerationServicer, WorkerSet]:
    """The router's servicer and worker set (on the event loop that will serve them: the
    worker channels are asyncio channels). `metrics` None: a private registry (tests)."""
    card = read_model_card(
        options.model,
        options.served_model_name,
        max_model_len=options.max_model_len,
        use_generation_config=options.use_generation_config,
    )
    tokenizer = RouterTokenizer.from_model_dir(options.model, options.chat_template)
    if options.tool_call_parser != "auto":
        tokenizer.chat.tool_call_parser = "" if options.tool_call_parser == "none" else (
            options.tool_call_parser
        )  # fmt: skip
    registry = index = None
    if options.redis_url:
        client = connect(options.redis_url)
        registry = WorkerRegistry(client, card.name)
        # NOTE: its own client with a short timeout: a lookup is on every request's path
        lookup_client = connect(options.redis_url, timeout_s=options.index_timeout_s)
        index = RedisPrefixIndex(lookup_client, card.name, block_size=options.block_size)
    fingerprint = model_fingerprint(
        card.config, dtype=options.dtype or card.dtype, revision=options.revision,
        weights=options.weights,
    )  # fmt: skip
    workers = WorkerSet(
        options.static_prefill,
        options.static_decode,
        registry,
        max_message_bytes=options.max_message_bytes,
        tls=options.client_tls,
        compat=compat_tag(fingerprint, options.block_size),
    )
    policy = RoutingPolicy(
        workers, index, block_size=options.block_size, local_prefill=options.local_prefill
    )
    tracing = setup_tracing(
        "pagedserve-router",
        options.otlp_traces_endpoint,
        include_text=options.trace_include_text,
        protocol=options.otlp_traces_protocol,
    )
    servicer = GenerationServicer(
        tokenizer, card, workers, policy, options.settings(fingerprint),
        tracing=tracing, metrics=metrics,
    )  # fmt: skip
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
        await self.handle.stop(grace_s)
        await self.servicer.orchestrator.clients.close()
        await self.workers.close()
        self.servicer.tracing.shutdown()


async def start_router(
    options: RouterOptions,
    metrics: RequestMetrics | None = None,
    *,
    keys: ApiKeys | None = None,
    tls: ServerTLS | None = None,
) -> RunningRouter:
    """Build the router of `options`, bind and start its server and its load poller, on the
    running event loop; ready (health SERVING) once a prefill and a decode worker answer."""
    servicer, workers = build_servicer(options, metrics)
    handle = await build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        address=f"{options.host}:{options.port}",
        max_message_bytes=options.max_message_bytes,
        interceptors=[AuthInterceptor(keys)] if keys is not None else [],
        tls=tls,
        # NOTE: a burst beyond our queue must reach admission control (RESOURCE_EXHAUSTED with
        # RetryInfo), not gRPC core's pending-call limit (a bare CANCELLED)
        max_pending_calls=max(DEFAULT_MAX_PENDING_CALLS, 4 * options.max_queued_requests),
    )
    await handle.add_health_port(health_address(options.host, options.health_port))
    await handle.start()
    router = RunningRouter(servicer, workers, handle, options.load_poll_interval_s)
    await router.refresh()
    router.poller = asyncio.create_task(router.poll_forever(), name="load-poller")
    return router


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    options = RouterOptions.from_args(args)
    stop = threading.Event()
    stop_on_signals(stop)
    return asyncio.run(_serve(options, stop))


async def _serve(options: RouterOptions, stop: threading.Event) -> int:
    keys = load_api_keys(options.api_key_file)  # NOTE: read at start, not import
    tls = options.server_tls
    router = await start_router(options, RequestMetrics(), keys=keys, tls=tls)
    _register_state_metrics(router.servicer)
    metrics_port = start_metrics_server(
        options.metrics_port, options.host, router.servicer.card.name, options.metrics_names
    )
    address = options.advertise_address or f"{options.host}:{router.handle.port}"
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
    await router.stop(options.drain_timeout_s)
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
