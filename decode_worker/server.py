"""`pagedserve decode`: the decode worker process.

Start-up: load the model, allocate the KV pool and the swap space, bind the gRPC server,
register in Redis as a decode worker (if `--redis-url`; a heartbeat carries the load), mark
ready, print `READY <worker_id> <address>` on stdout. SIGTERM/SIGINT: health NOT_SERVING, refuse
new requests, let in-flight streams finish up to `--drain-timeout`, deregister, stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time

from pagedserve.cluster import ClusterMember, join, model_key
from pagedserve.config import default_worker_id
from pagedserve.core_share import one_torch_thread, open_core_share
from pagedserve.decode_worker.cli_args import DEFAULT_MAX_SWAP_GIB, add_arguments
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.kv_import import ProducerClients
from pagedserve.decode_worker.plan import KVPolicy, PreemptionMode, SchedulingPolicy
from pagedserve.decode_worker.servicer import DecodeServicer
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.grpcutil import (
    EngineLoop,
    ServerHandle,
    build_server,
    client_tls_from_args,
    server_tls_from_args,
)
from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.kvstore.swap_space import GIB
from pagedserve.kvstore.worker_registry import Role, compat_tag, connect
from pagedserve.metrics import CounterSource, Gauge, TransferCounts, register_state
from pagedserve.model.config import load_model_config
from pagedserve.model.quant import weight_quant_from_args
from pagedserve.model.runner import kv_cache_spec, rank_kv_cache_bytes
from pagedserve.model.tp_pipes import RankLost
from pagedserve.model.tp_ranks import shard_model
from pagedserve.signals import stop_on_signals
from pagedserve.telemetry import setup_tracing, start_metrics_server
from pagedserve.v1 import decode_pb2_grpc

log = logging.getLogger("pagedserve.decode")
SERVICE_NAME = "pagedserve.v1.DecodeWorker"


def engine_config(args: argparse.Namespace) -> DecodeEngineConfig:
    """The engine's config from the flags; ValueError naming the flag if they do not fit."""
    if args.swap_space is not None and args.swap_space < 0:
        raise ValueError(f"swap-space: must be >= 0 GiB, got {args.swap_space}")
    if args.import_threads < 1:
        raise ValueError(f"import-threads: must be >= 1, got {args.import_threads}")
    quantization = weight_quant_from_args(args)
    model_config = load_model_config(args.model, args.dtype, quantization, args.kv_cache_dtype)
    ranks = args.tensor_parallel_size
    rank_config = shard_model(model_config, 0, ranks) if ranks > 1 else model_config
    spec = kv_cache_spec(rank_config, args.block_size)
    memory = rank_kv_cache_bytes(rank_config, args, ranks)
    num_blocks = args.num_gpu_blocks_override or spec.num_blocks_for(memory)
    if num_blocks < 1:
        raise ValueError("kv-cache-memory: too small for one block")
    return DecodeEngineConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        eviction_policy=EvictionPolicy(args.eviction_policy),
        dtype=args.dtype,
        quantization=quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        tensor_parallel_size=ranks,
        swap_space_gib=swap_space_gib(args.swap_space, num_blocks * spec.bytes_per_block),
        preemption_mode=PreemptionMode(args.preemption_mode),
        scheduling_policy=SchedulingPolicy(args.scheduling_policy),
        kv_policy=KVPolicy(args.kv_policy),
    )


def swap_space_gib(flag: float | None, kv_pool_bytes: int) -> float:
    """`--swap-space`, or its default: as large as the device pool, at most the cap."""
    if flag is not None:
        return flag
    return min(DEFAULT_MAX_SWAP_GIB, kv_pool_bytes / GIB)


def main(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run a decode worker until `stop` (made here, set by SIGTERM / SIGINT, when not given)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if stop is None:
        stop = threading.Event()
        stop_on_signals(stop)
    if stop.is_set():  # NOTE: stopped while starting: nothing is loaded yet
        return 0
    engine = DecodeEngine.from_model_dir(args.model, engine_config(args), revision=args.revision)
    if stop.is_set():  # NOTE: stopped while loading: nothing is bound or registered yet
        engine.close()
        return 0
    loop = EngineLoop("decode-loop", on_main_thread=True)
    return loop.serve_on_side_thread(lambda: serve(args, engine, stop, loop), one_torch_thread)


async def serve(
    args: argparse.Namespace,
    engine: DecodeEngine,
    stop: threading.Event,
    engine_loop: EngineLoop | None = None,
) -> int:
    """Serve `engine` on a `grpc.aio` server until `stop` is set, then drain and stop."""
    tracing = setup_tracing(
        "pagedserve-decode", args.otlp_traces_endpoint, include_text=args.trace_include_text
    )
    worker = DecodeWorker(
        engine,
        import_threads=args.import_threads,
        producers=ProducerClients(args.max_message_bytes, client_tls_from_args(args)),
        tracing=tracing,
    )
    _register_metrics(worker)
    start_metrics_server(args.metrics_port, args.host)
    servicer = DecodeServicer(worker)
    handle = await build_server(
        [lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        address=f"{args.host}:{args.port}",
        max_message_bytes=args.max_message_bytes,
        tls=server_tls_from_args(args),
    )
    address = args.advertise_address or f"{args.host}:{handle.port}"
    worker.worker_id = args.worker_id or default_worker_id("decode", handle.port)
    member = await asyncio.to_thread(_join_cluster, args, worker, address)
    worker.core_share = open_core_share(
        args.core_share, set_threads=worker.engine.runner.set_threads
    )
    if engine_loop is not None:
        worker.engine_loop = engine_loop
    worker.on_loop_death = lambda: _on_loop_death(handle, worker.death, stop)
    worker.start()
    await handle.server.start()
    await handle.set_ready(True)
    print(f"READY {worker.worker_id} {address}", flush=True)
    await asyncio.to_thread(stop.wait)

    log.info("draining: %d requests in flight", worker.num_in_flight)
    await handle.set_ready(False)
    worker.draining = True
    deadline = time.monotonic() + args.drain_timeout
    while worker.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if member is not None:
        await asyncio.to_thread(member.leave)
    servicer.end_deliveries()  # NOTE: else each router's Deliver stream holds the grace period
    await handle.server.stop(grace=1.0)
    servicer.close()
    worker.close()
    tracing.shutdown()
    return 1 if isinstance(worker.death, RankLost) else 0


def _on_loop_death(handle: ServerHandle, death: BaseException | None, stop: threading.Event):
    """Health NOT_SERVING; a lost tensor-parallel rank also stops the worker (it cannot step
    again: exiting lets `pagedserve up` or Kubernetes start it afresh)."""
    handle.set_ready_threadsafe(False)
    if isinstance(death, RankLost):
        log.error("stopping: %s", death)
        stop.set()


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
            Gauge("num_preemptions", "Preemptions since start (swap + recompute).",
                  lambda: worker.engine.scheduler.stats.num_preemptions),
        ],
        [
            CounterSource("decode_", lambda: worker.engine.scheduler.stats),
            CounterSource("kv_import_", lambda: worker.importer.stats),
            CounterSource("kv_transfer_", lambda: TransferCounts(
                bytes_shm=worker.importer.stats.blocks_pulled_shm * block_bytes,
                bytes_grpc=worker.importer.stats.blocks_pulled_grpc * block_bytes,
            )),
        ],
    )  # fmt: skip


def _join_cluster(
    args: argparse.Namespace, worker: DecodeWorker, address: str
) -> ClusterMember | None:
    if not args.redis_url:
        return None
    client, model = connect(args.redis_url), model_key(args.served_model_name, args.model)
    compat = compat_tag(worker.engine.fingerprint, worker.engine.config.block_size)
    return join(client, model, worker.worker_id, address, Role.DECODE, worker.load, compat=compat)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedserve decode")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
