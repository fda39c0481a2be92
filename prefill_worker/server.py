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
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.cluster import ClusterMember, join, model_key
from pagedserve.config import default_worker_id
from pagedserve.core_share import one_torch_thread, open_core_share
from pagedserve.grpcutil import (
    DEFAULT_MAX_MESSAGE_BYTES,
    EngineLoop,
    ServerHandle,
    ServerTLS,
    build_server,
    server_tls_from_args,
)
from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import (
    Role,
    WorkerLoad,
    compat_tag,
    connect,
    new_incarnation,
)
from pagedserve.metrics import CounterSource, Gauge, PrefixCacheCounts, register_state
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import weight_quant_from_args
from pagedserve.model.runner import kv_cache_spec, rank_kv_cache_bytes
from pagedserve.model.tp_pipes import RankLost
from pagedserve.model.tp_ranks import shard_model
from pagedserve.prefill_worker.cli_args import add_arguments
from pagedserve.prefill_worker.convert import Identity, worker_load
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.index_publisher import IndexPublisher
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.prefill_worker.warmup import load_warmup_prompts
from pagedserve.prefill_worker.worker import PrefillWorker
from pagedserve.signals import stop_on_signals
from pagedserve.telemetry import setup_tracing, start_metrics_server
from pagedserve.v1 import prefill_pb2_grpc

log = logging.getLogger("pagedserve.prefill")
SERVICE_NAME = "pagedserve.v1.PrefillWorker"
WARMUP_TIMEOUT_S = 600.0


@dataclass(slots=True)
class _Cluster:
    """This worker's membership in Redis: its record and heartbeat, and its index entries."""

    member: ClusterMember
    publisher: IndexPublisher

    def leave(self) -> None:
        """Stop beating and publishing, delete the index entries, then the record (best effort)."""
        self.member.leave(before_deregister=self._clear_index)

    def _clear_index(self) -> None:
        self.publisher.stop()
        self.publisher.clear()


def build_engine(args: argparse.Namespace) -> PrefillEngine:
    model_config = load_model_config(
        args.model, args.dtype, weight_quant_from_args(args), args.kv_cache_dtype
    )
    ranks = args.tensor_parallel_size
    rank_config = shard_model(model_config, 0, ranks) if ranks > 1 else model_config
    spec = kv_cache_spec(rank_config, args.block_size)
    memory = rank_kv_cache_bytes(rank_config, args, ranks)
    num_blocks = args.num_gpu_blocks_override or spec.num_blocks_for(memory)
    if num_blocks < 1:
        raise ValueError("kv-cache-memory: too small for one block")
    config = PrefillEngineConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        eviction_policy=EvictionPolicy(args.eviction_policy),
        lease_seconds=args.kv_lease_seconds,
        use_shm=not args.no_shm and args.device == "cpu",
        tensor_parallel_size=ranks,
    )
    model = load_model(model_config, args.device) if ranks == 1 else None
    return PrefillEngine(model_config, model, config, device=args.device, revision=args.revision)


def main(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run a prefill worker until `stop` (made here, set by SIGTERM / SIGINT, when not given)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if stop is None:
        stop = threading.Event()
        stop_on_signals(stop)
    if stop.is_set():  # NOTE: stopped while starting: nothing is loaded yet
        return 0
    if args.heartbeat_interval is not None and not 0 < args.heartbeat_interval < args.worker_ttl:
        raise ValueError("heartbeat-interval: must be in (0, --worker-ttl)")
    warmup = load_warmup_prompts(args.warmup_prompts, args.model) if args.warmup_prompts else []
    worker = PrefillWorker(build_engine(args))
    worker.core_share = open_core_share(
        args.core_share, borrow=False, set_threads=worker.engine.runner.set_threads
    )
    if stop.is_set():
        worker.close()
        return 0
    worker.engine_loop = EngineLoop("prefill-loop", on_main_thread=True)
    return worker.engine_loop.serve_on_side_thread(
        lambda: serve(args, worker, warmup, stop), one_torch_thread
    )


async def serve(
    args: argparse.Namespace, worker: PrefillWorker, warmup: list[list[int]], stop: threading.Event
) -> int:
    """Serve `worker` on a `grpc.aio` server until `stop` is set, then drain and stop."""
    tracing = setup_tracing(
        "pagedserve-prefill", args.otlp_traces_endpoint, include_text=args.trace_include_text
    )
    servicer = PrefillServicer(worker, Identity("", "", ""), tracing)
    _register_metrics(worker)
    start_metrics_server(args.metrics_port, args.host)
    handle = await build_grpc_server(
        servicer,
        address=f"{args.host}:{args.port}",
        max_message_bytes=args.max_message_bytes,
        tls=server_tls_from_args(args),
    )
    address = args.advertise_address or f"{args.host}:{handle.port}"
    worker_id = args.worker_id or default_worker_id("prefill", handle.port)
    me = Identity(worker_id, new_incarnation(), address)
    servicer.me = me
    cluster = await asyncio.to_thread(_join_cluster, args, worker, me)
    ready_hook = worker.on_loop_death
    worker.on_loop_death = lambda: _on_loop_death(ready_hook, worker.death, stop)
    worker.start()
    try:
        await asyncio.to_thread(_warm_up, worker, warmup, cluster)
    except Exception:
        if cluster is not None:
            cluster.leave()
        worker.close()
        raise
    await handle.server.start()
    await handle.set_ready(not worker.dead)  # NOTE: the loop may have died before we turned ready
    print(f"READY {worker_id} {address}", flush=True)
    await asyncio.to_thread(stop.wait)

    log.info("draining: %d leases outstanding", len(worker.leases))
    await handle.set_ready(False)
    servicer.draining = True
    deadline = time.monotonic() + args.drain_timeout
    while len(worker.leases) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    worker.stop()  # NOTE: no step may publish after the index entries are cleared
    if cluster is not None:
        await asyncio.to_thread(cluster.leave)
    await handle.server.stop(grace=1.0)
    worker.close()
    tracing.shutdown()
    return 1 if isinstance(worker.death, RankLost) else 0


def _on_loop_death(
    ready_hook: Callable[[], None] | None, death: BaseException | None, stop: threading.Event
) -> None:
    """Health NOT_SERVING; a lost tensor-parallel rank also stops the worker (it cannot step
    again: exiting lets `pagedserve up` or Kubernetes start it afresh)."""
    if ready_hook is not None:
        ready_hook()
    if isinstance(death, RankLost):
        log.error("stopping: %s", death)
        stop.set()


async def build_grpc_server(
    servicer: PrefillServicer,
    *,
    address: str = "127.0.0.1:0",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: ServerTLS | None = None,
) -> ServerHandle:
    """The worker's gRPC server (not started, NOT_SERVING until `set_ready(True)`), on the
    running event loop.

    Health follows the worker: if its loop thread dies, every service turns NOT_SERVING.
    """
    handle = await build_server(
        [lambda s: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        address=address,
        max_message_bytes=max_message_bytes,
        tls=tls,
    )
    servicer.worker.on_loop_death = lambda: handle.set_ready_threadsafe(False)
    return handle


def _warm_up(worker: PrefillWorker, prompts: list[list[int]], cluster: _Cluster | None) -> None:
    """Prefill the warm-up prompts and wait until their blocks are in Redis (bounded)."""
    if not prompts:
        return
    blocks = worker.warmup(prompts, timeout_s=WARMUP_TIMEOUT_S)
    log.info("warm-up: %d prompts, %d full blocks cached", len(prompts), blocks)
    if cluster is not None and not cluster.publisher.flush(timeout_s=5.0):
        log.warning("warm-up blocks not yet published to Redis")


def _join_cluster(args: argparse.Namespace, worker: PrefillWorker, me: Identity) -> _Cluster | None:
    if not args.redis_url:
        return None
    client, model = connect(args.redis_url), model_key(args.served_model_name, args.model)
    publisher = IndexPublisher(
        RedisPrefixIndex(client, model, block_size=args.block_size),
        me.worker_id,
        me.incarnation,
        worker,
    )
    worker.on_events = publisher.submit
    publisher.start()

    def load() -> WorkerLoad:
        # NOTE: called on every heartbeat; also the idle-time hook for the index refresh
        publisher.refresh()
        return worker_load(worker.engine, draining=worker.dead)

    member = join(
        client, model, me.worker_id, me.address, Role.PREFILL, load,
        compat=compat_tag(worker.engine.fingerprint, args.block_size),
        incarnation=me.incarnation,
        ttl_s=args.worker_ttl,
        heartbeat_interval_s=args.heartbeat_interval,
        # NOTE: a re-created record means Redis lost our keys (restart, or TTL ran out)
        on_recreated=lambda: publisher.refresh(force=True),
    )  # fmt: skip
    if not member.registered:
        log.warning("serving without the prefix index until Redis returns")
        publisher.stale = True
    return _Cluster(member, publisher)


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
            Gauge("prompt_tokens_computed", "Prompt tokens computed since start.",
                  lambda: engine.num_prompt_tokens_computed),
            Gauge("prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
                  lambda: engine.num_prompt_tokens_cached),
        ],
        [
            CounterSource("kv_leases_", worker.leases.stats, gauge_fields=("active",)),
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
