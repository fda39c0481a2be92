"""`pagedserve prefill`: the prefill worker process.

Start-up: load the model, allocate the KV pool (in shared memory), bind the gRPC server, register
in Redis (if `--redis-url`), prefill `--warmup-prompts` into the prefix cache and publish them,
mark ready, print `READY <worker_id> <address>` on stdout. While serving, block events go to the
Redis prefix index after every step (`IndexPublisher`, off the worker's loop) and a heartbeat
keeps the worker record alive; a Redis outage only makes the index stale (docs/prefill.md).
If the worker's loop dies, health turns NOT_SERVING and load reports draining.
SIGTERM/SIGINT: health NOT_SERVING, refuse new prefills, wait for outstanding leases up to
`--drain-timeout`, stop the worker's loop, delete the index entries and the record, stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve import worker_server
from pagedserve.cluster import IndexedMember, join_indexed, model_key
from pagedserve.core_share import open_core_share
from pagedserve.engine_sizing import EngineSizing, size_engine
from pagedserve.grpcutil import (
    DEFAULT_MAX_MESSAGE_BYTES,
    EngineLoop,
    ServerHandle,
    ServerTLS,
    build_server,
)
from pagedserve.internal.v1 import prefill_pb2_grpc
from pagedserve.kvstore.host_tier import OFFLOAD_GAUGES
from pagedserve.kvstore.index_publisher import IndexEvents
from pagedserve.kvstore.kv_cache_manager import offload_counts
from pagedserve.kvstore.worker_registry import Role, compat_tag, new_incarnation
from pagedserve.logs import setup_logging
from pagedserve.metrics import (
    CounterSource,
    Gauge,
    PhaseMetrics,
    PrefixCacheCounts,
    PromptTokenCounts,
    register_state,
)
from pagedserve.model.tp_pipes import RankLost
from pagedserve.prefill_worker.cli_args import add_arguments
from pagedserve.prefill_worker.convert import Identity, worker_load
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.prefill_worker.warmup import load_warmup_prompts
from pagedserve.prefill_worker.worker import PrefillWorker
from pagedserve.telemetry import setup_tracing, start_metrics_server
from pagedserve.worker_hooks import WorkerHooks

log = logging.getLogger("pagedserve.prefill")
SERVICE_NAME = "pagedserve.internal.v1.PrefillWorker"
WARMUP_TIMEOUT_S = 600.0


def engine_config(args: argparse.Namespace, sizing: EngineSizing) -> PrefillEngineConfig:
    """The engine's config: the sized fields both workers share, then the prefill worker's."""
    return PrefillEngineConfig(
        **sizing.fields,
        lease_seconds=args.kv_lease_seconds,
        use_shm=not args.no_shm and args.device == "cpu",
    )


def build_engine(args: argparse.Namespace) -> PrefillEngine:
    """Load the model and build the engine the flags size (engine_sizing.py)."""
    sizing = size_engine(args)
    config = engine_config(args, sizing)
    return PrefillEngine.from_model_config(sizing.model_config, config, revision=args.revision)


def main(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run a prefill worker until `stop` (made here, set by SIGTERM / SIGINT, when not given)."""
    setup_logging(args.log_level, args.log_format)
    if args.heartbeat_interval is not None and not 0 < args.heartbeat_interval < args.worker_ttl:
        raise ValueError("heartbeat-interval: must be in (0, --worker-ttl)")
    return worker_server.run("prefill", stop, lambda stop, loop: _start(args, stop, loop))


def _start(
    args: argparse.Namespace, stop: threading.Event, engine_loop: EngineLoop
) -> worker_server.Serve | None:
    warmup = load_warmup_prompts(args.warmup_prompts, args.model) if args.warmup_prompts else []
    engine = build_engine(args)
    death, events = worker_server.LoopDeath(stop), IndexEvents()
    core_share = open_core_share(
        args.core_share, borrow=False, set_threads=engine.runner.set_threads
    )
    hooks = WorkerHooks(engine_loop, core_share, death)
    worker = PrefillWorker(engine, hooks, on_events=events.submit)
    if stop.is_set():  # NOTE: stopped while loading: nothing is bound or registered yet
        worker.close()
        return None
    return lambda: serve(args, worker, warmup, stop, _Wiring(death, events))


@dataclass(frozen=True, slots=True)
class _Wiring:
    """Where the worker's hooks lead; `serve` points them at the server and the publisher."""

    death: worker_server.LoopDeath
    events: IndexEvents


async def serve(
    args: argparse.Namespace,
    worker: PrefillWorker,
    warmup: list[list[int]],
    stop: threading.Event,
    wiring: _Wiring,
) -> int:
    """Serve `worker` on a `grpc.aio` server until `stop` is set, then drain and stop."""
    tracing = setup_tracing(
        "pagedserve-prefill", args.otlp_traces_endpoint, include_text=args.trace_include_text,
        protocol=args.otlp_traces_protocol,
    )  # fmt: skip
    servicer = PrefillServicer(worker, Identity("", "", ""), tracing)
    _register_metrics(worker)
    servicer.phases = PhaseMetrics()
    start_metrics_server(
        args.metrics_port, args.host, model_key(args.served_model_name, args.model),
        args.metrics_names,
    )  # fmt: skip
    bound = await worker_server.bind(args, "prefill", [_servicer_adder(servicer)], [SERVICE_NAME])
    wiring.death.handle = bound.handle
    me = Identity(bound.worker_id, new_incarnation(), bound.address)
    servicer.me = me
    cluster = await asyncio.to_thread(_join_cluster, args, worker, me, wiring.events)
    worker.start()
    try:
        await asyncio.to_thread(_warm_up, worker, warmup, cluster)
    except Exception:
        if cluster is not None:
            cluster.leave()
        worker.close()
        raise
    # NOTE: the loop may have died before we turned ready
    await worker_server.announce_ready(bound, ready=not worker.dead)
    await asyncio.to_thread(stop.wait)

    log.info("draining: %d leases outstanding", len(worker.leases))
    await bound.handle.set_ready(False)
    servicer.draining = True
    await worker_server.wait_drained(lambda: len(worker.leases), args.drain_timeout)
    worker.stop()  # NOTE: no step may publish after the index entries are cleared
    if cluster is not None:
        await asyncio.to_thread(cluster.leave)
    await bound.handle.stop(grace=1.0)
    worker.close()
    tracing.shutdown()
    return 1 if isinstance(worker.death, RankLost) else 0


def _servicer_adder(servicer: PrefillServicer) -> Callable[[Any], None]:
    return lambda server: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)


async def build_grpc_server(
    servicer: PrefillServicer,
    *,
    address: str = "127.0.0.1:0",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: ServerTLS | None = None,
) -> ServerHandle:
    """A prefill gRPC server over `servicer` (not started, NOT_SERVING until
    `set_ready(True)`), on the running event loop (tests serve a worker with it)."""
    return await build_server(
        [_servicer_adder(servicer)],
        [SERVICE_NAME],
        address=address,
        max_message_bytes=max_message_bytes,
        tls=tls,
    )


def _warm_up(
    worker: PrefillWorker, prompts: list[list[int]], cluster: IndexedMember | None
) -> None:
    """Prefill the warm-up prompts and wait until their blocks are in Redis (bounded)."""
    if not prompts:
        return
    blocks = worker.warmup(prompts, timeout_s=WARMUP_TIMEOUT_S)
    log.info("warm-up: %d prompts, %d full blocks cached", len(prompts), blocks)
    if cluster is not None and not cluster.publisher.flush(timeout_s=5.0):
        log.warning("warm-up blocks not yet published to Redis")


def _join_cluster(
    args: argparse.Namespace, worker: PrefillWorker, me: Identity, events: IndexEvents
) -> IndexedMember | None:
    registry = worker_server.connect_registry(args)
    if registry is None:
        return None
    client, model = registry
    return join_indexed(
        client, model, me.worker_id, me.address, Role.PREFILL,
        lambda: worker_load(worker.engine, draining=worker.dead),
        worker, events,
        compat=compat_tag(worker.engine.fingerprint, args.block_size),
        incarnation=me.incarnation,
        block_size=args.block_size,
        ttl_s=args.worker_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
    )  # fmt: skip


def _register_metrics(worker: PrefillWorker) -> None:
    """Scrape-time metrics from the engine's pool and scheduler and the worker's lease table."""
    engine = worker.engine
    pool, scheduler = engine.pool, engine.scheduler
    register_state(
        [
            Gauge("num_requests_running", "Prompts being prefilled.",
                  lambda: len(scheduler.running)),
            Gauge("num_requests_waiting", "Prompts queued.", lambda: scheduler.num_waiting),
            Gauge("queued_prefill_tokens", "Prompt tokens not yet computed.",
                  lambda: scheduler.queued_tokens),
            Gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (leased or filling).",
                  lambda: pool.usage),
            Gauge("kv_blocks_cached", "Blocks kept for prefix reuse (ref count 0).",
                  lambda: pool.num_cached),
        ],
        [
            CounterSource("prompt_tokens_", lambda: PromptTokenCounts(
                computed=engine.num_prompt_tokens_computed,
                cached=engine.num_prompt_tokens_cached,
            )),
            CounterSource("kv_leases_", worker.leases.stats, gauge_fields=("active",)),
            CounterSource("kv_offload_", lambda: offload_counts(engine.kv),
                          gauge_fields=OFFLOAD_GAUGES),
            CounterSource("prefix_cache_", lambda: PrefixCacheCounts(
                queries=engine.num_prompt_tokens_computed + engine.num_prompt_tokens_cached,
                hits=engine.num_prompt_tokens_cached,
            )),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedserve prefill")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
