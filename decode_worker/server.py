"""`pagedserve decode`: the decode worker process.

Start-up: load the model, allocate the KV pool and the swap space, bind the gRPC server,
register in Redis as a decode worker (if `--redis-url`; a heartbeat carries the load), mark
ready, print `READY <worker_id> <address>` on stdout. While serving, the blocks it computes or
imports go to the Redis prefix index after every step (`IndexPublisher`, off the worker's loop,
as a prefill worker's do), so the router can send a conversation's next turn here.
SIGTERM/SIGINT: health NOT_SERVING, refuse new requests, let in-flight streams finish up to
`--drain-timeout`, delete the index entries and the record, stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from pagedserve import worker_server
from pagedserve.cluster import IndexedMember, join_indexed, model_key
from pagedserve.core_share import open_core_share
from pagedserve.decode_worker.cli_args import DEFAULT_MAX_SWAP_GIB, add_arguments
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.kv_import import ProducerClients
from pagedserve.decode_worker.plan import KVPolicy, PreemptionMode, SchedulingPolicy
from pagedserve.decode_worker.servicer import DecodeServicer
from pagedserve.decode_worker.speculation import SpeculativeConfig, SpeculativeMethod
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.engine_sizing import EngineSizing, size_engine
from pagedserve.grpcutil import EngineLoop, client_tls_from_args
from pagedserve.internal.v1 import decode_pb2_grpc
from pagedserve.kvstore.host_tier import OFFLOAD_GAUGES
from pagedserve.kvstore.index_publisher import IndexEvents
from pagedserve.kvstore.kv_cache_manager import offload_counts
from pagedserve.kvstore.swap_space import GIB
from pagedserve.kvstore.worker_registry import Role, compat_tag, new_incarnation
from pagedserve.logs import setup_logging
from pagedserve.metrics import (
    CounterSource,
    Gauge,
    PhaseMetrics,
    PreemptionCounts,
    TransferCounts,
    register_state,
)
from pagedserve.model.config import load_model_config
from pagedserve.model.runner import kv_cache_spec
from pagedserve.model.tp_pipes import RankLost
from pagedserve.telemetry import setup_tracing, start_metrics_server
from pagedserve.worker_hooks import WorkerHooks

log = logging.getLogger("pagedserve.decode")
SERVICE_NAME = "pagedserve.internal.v1.DecodeWorker"


def engine_config(args: argparse.Namespace, sizing: EngineSizing) -> DecodeEngineConfig:
    """The engine's config: the sized fields both workers share, then the decode worker's;
    ValueError naming the flag if they do not fit."""
    if args.swap_space is not None and args.swap_space < 0:
        raise ValueError(f"swap-space: must be >= 0 GiB, got {args.swap_space}")
    if args.import_threads < 1:
        raise ValueError(f"import-threads: must be >= 1, got {args.import_threads}")
    return DecodeEngineConfig(
        **sizing.fields,
        swap_space_gib=swap_space_gib(args.swap_space, sizing.kv_pool_bytes),
        preemption_mode=PreemptionMode(args.preemption_mode),
        scheduling_policy=SchedulingPolicy(args.scheduling_policy),
        kv_policy=KVPolicy(args.kv_policy),
        speculative=speculative_config(args),
    )


def draft_bytes_per_block(args: argparse.Namespace) -> int:
    """The KV bytes a draft model (`--speculative-model`) adds to every block; 0 without."""
    if args.speculative_model is None:
        return 0
    draft = load_model_config(args.speculative_model, args.dtype)
    return kv_cache_spec(draft, args.block_size).bytes_per_block


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """`--speculative-method` and its companions (ValueError naming the flag if bad)."""
    if args.speculative_method is None:
        if args.speculative_model is not None:
            raise ValueError("speculative-model: goes with --speculative-method draft")
        return None
    return SpeculativeConfig(
        method=SpeculativeMethod(args.speculative_method),
        num_tokens=args.num_speculative_tokens,
        ngram_min=args.speculative_ngram_min,
        ngram_max=args.speculative_ngram_max,
        max_batch=args.speculative_max_batch,
        draft_model=args.speculative_model,
    )


def swap_space_gib(flag: float | None, kv_pool_bytes: int) -> float:
    """`--swap-space`, or its default: as large as the device pool, at most the cap."""
    if flag is not None:
        return flag
    return min(DEFAULT_MAX_SWAP_GIB, kv_pool_bytes / GIB)


def build_engine(args: argparse.Namespace) -> DecodeEngine:
    """Load the model and build the engine the flags size (engine_sizing.py)."""
    sizing = size_engine(args, draft_bytes_per_block(args))
    config = engine_config(args, sizing)
    return DecodeEngine.from_model_config(sizing.model_config, config, revision=args.revision)


def main(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run a decode worker until `stop` (made here, set by SIGTERM / SIGINT, when not given)."""
    setup_logging(args.log_level, args.log_format)
    return worker_server.run("decode", stop, lambda stop, loop: _start(args, stop, loop))


def _start(
    args: argparse.Namespace, stop: threading.Event, engine_loop: EngineLoop
) -> worker_server.Serve | None:
    engine = build_engine(args)
    if stop.is_set():  # NOTE: stopped while loading: nothing is bound or registered yet
        engine.close()
        return None
    return lambda: serve(args, engine, stop, engine_loop)


async def serve(
    args: argparse.Namespace,
    engine: DecodeEngine,
    stop: threading.Event,
    engine_loop: EngineLoop | None = None,
) -> int:
    """Serve `engine` on a `grpc.aio` server until `stop` is set, then drain and stop."""
    tracing = setup_tracing(
        "pagedserve-decode", args.otlp_traces_endpoint, include_text=args.trace_include_text,
        protocol=args.otlp_traces_protocol,
    )  # fmt: skip
    death = worker_server.LoopDeath(stop)
    core_share = open_core_share(args.core_share, set_threads=engine.runner.set_threads)
    events = IndexEvents()
    worker = DecodeWorker(
        engine,
        import_threads=args.import_threads,
        producers=ProducerClients(args.max_message_bytes, client_tls_from_args(args)),
        tracing=tracing,
        hooks=WorkerHooks(engine_loop, core_share, death),
        on_events=events.submit,
    )
    _register_metrics(worker)
    worker.phases = PhaseMetrics()
    start_metrics_server(
        args.metrics_port, args.host, model_key(args.served_model_name, args.model),
        args.metrics_names,
    )  # fmt: skip
    servicer = DecodeServicer(worker)
    bound = await worker_server.bind(args, "decode", [_servicer_adder(servicer)], [SERVICE_NAME])
    death.handle = bound.handle
    worker.worker_id = bound.worker_id  # NOTE: known once bound (`--port 0`)
    member = await asyncio.to_thread(_join_cluster, args, worker, bound.address, events)
    worker.start()
    await worker_server.announce_ready(bound)
    await asyncio.to_thread(stop.wait)

    log.info("draining: %d requests in flight", worker.num_in_flight)
    await bound.handle.set_ready(False)
    worker.draining = True
    await worker_server.wait_drained(lambda: worker.num_in_flight, args.drain_timeout)
    if member is not None:
        await asyncio.to_thread(member.leave)
    servicer.end_deliveries()  # NOTE: else each router's Deliver stream holds the grace period
    await bound.handle.stop(grace=1.0)
    servicer.close()
    worker.close()
    tracing.shutdown()
    return 1 if isinstance(worker.death, RankLost) else 0


def _servicer_adder(servicer: DecodeServicer) -> Callable[[Any], None]:
    return lambda server: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)


def _register_metrics(worker: DecodeWorker) -> None:
    """Scrape-time metrics from the worker's load, scheduler and import counters."""

    def load():
        return worker.load()

    block_bytes = worker.engine.runner.spec.bytes_per_block

    register_state(
        [
            Gauge("num_requests_running", "Sequences in the running batch.",
                  lambda: load().num_requests_running),
            Gauge("num_requests_waiting", "Sequences waiting (or importing their KV).",
                  lambda: load().num_requests_waiting),
            Gauge("num_requests_swapped", "Sequences swapped out to host memory.",
                  lambda: load().num_requests_swapped),
            Gauge("kv_cache_usage_perc", "Fraction of KV blocks in use.",
                  lambda: load().kv_cache_usage),
            Gauge("kv_blocks_cached", "Blocks kept for prefix reuse (ref count 0).",
                  lambda: load().kv_blocks_cached),
        ],
        [
            CounterSource("", lambda: PreemptionCounts(
                worker.engine.scheduler.stats.num_preemptions)),
            CounterSource("decode_", lambda: worker.engine.scheduler.stats),
            # NOTE: vLLM's spec_decode_num_{drafts,draft_tokens,accepted_tokens}; none when off
            CounterSource("spec_decode_", lambda: worker.engine.speculation_stats),
            CounterSource("kv_import_", lambda: worker.importer.stats),
            CounterSource("kv_offload_", lambda: offload_counts(worker.engine.kv),
                          gauge_fields=OFFLOAD_GAUGES),
            CounterSource("kv_transfer_", lambda: TransferCounts(
                bytes_shm=worker.importer.stats.blocks_pulled_shm * block_bytes,
                bytes_grpc=worker.importer.stats.blocks_pulled_grpc * block_bytes,
            )),
        ],
    )  # fmt: skip


def _join_cluster(
    args: argparse.Namespace, worker: DecodeWorker, address: str, events: IndexEvents
) -> IndexedMember | None:
    registry = worker_server.connect_registry(args)
    if registry is None:
        return None
    client, model = registry
    block_size = worker.engine.config.block_size
    return join_indexed(
        client,
        model,
        worker.worker_id,
        address,
        Role.DECODE,
        worker.load,
        worker,
        events,
        compat=compat_tag(worker.engine.fingerprint, block_size),
        incarnation=new_incarnation(),
        block_size=block_size,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedserve decode")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
