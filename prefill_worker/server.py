"""`pagedserve prefill`: the prefill worker process.

Start-up: load the model, allocate the KV pool (in shared memory), bind the gRPC server, register
in Redis (if `--redis-url`), mark ready, print `READY <worker_id> <address>` on stdout. While
serving, block events are published to the Redis prefix index after every step and a heartbeat
keeps the worker record alive. SIGTERM/SIGINT: health NOT_SERVING, refuse new prefills, wait
for outstanding leases up to `--drain-timeout`, deregister, stop.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from pagedserve.config import default_worker_id
from pagedserve.grpcutil import build_server
from pagedserve.kvstore.block_pool import BlockEvent
from pagedserve.kvstore.prefix_index import IndexUnavailable, RedisPrefixIndex
from pagedserve.kvstore.worker_registry import (
    Heartbeater,
    RegistryUnavailable,
    Role,
    WorkerLoad,
    WorkerRegistry,
    connect,
    new_incarnation,
)
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.runner import kv_cache_spec
from pagedserve.prefill_worker.cli_args import add_arguments
from pagedserve.prefill_worker.convert import Identity, load_report
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.servicer import PrefillServicer
from pagedserve.v1 import prefill_pb2_grpc

log = logging.getLogger("pagedserve.prefill")
SERVICE_NAME = "pagedserve.v1.PrefillWorker"


@dataclass(slots=True)
class _IndexPublisher:
    """Mirrors the pool's block events into Redis.

    A failed publish marks the index stale; the next successful call republishes every hash the
    pool holds. Entries also get re-asserted every `refresh_interval_s` (half the entry TTL),
    because prefix hits keep blocks hot without producing events.
    """

    index: RedisPrefixIndex
    worker_id: str
    incarnation: str
    engine: PrefillEngine
    refresh_interval_s: float = 300.0
    stale: bool = False
    last_refresh: float = field(default_factory=time.monotonic)

    def publish(self, events: list[BlockEvent]) -> None:
        try:
            self.maybe_refresh()
            self.index.publish(self.worker_id, events, incarnation=self.incarnation)
        except IndexUnavailable:
            self.stale = True  # NOTE: Redis is a hint; serving goes on without it

    def maybe_refresh(self) -> None:
        """Republish if stale or due; raises IndexUnavailable."""
        if self.stale or time.monotonic() - self.last_refresh > self.refresh_interval_s:
            hashes = self.engine.registered_hashes()
            self.index.refresh(self.worker_id, hashes, incarnation=self.incarnation)
            self.stale = False
            self.last_refresh = time.monotonic()


def build_engine(args: argparse.Namespace) -> PrefillEngine:
    model_config = load_model_config(args.model, args.dtype)
    spec = kv_cache_spec(model_config, args.block_size)
    num_blocks = args.num_gpu_blocks_override or spec.num_blocks_for(args.kv_cache_memory)
    if num_blocks < 1:
        raise ValueError("kv-cache-memory: too small for one block")
    config = PrefillEngineConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        lease_seconds=args.kv_lease_seconds,
        use_shm=not args.no_shm and args.device == "cpu",
    )
    model = load_model(model_config, args.device)
    return PrefillEngine(model_config, model, config, device=args.device, revision=args.revision)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    engine = build_engine(args)
    if stop.is_set():
        engine.close()
        return 0
    servicer = PrefillServicer(engine, Identity("", "", ""))
    handle = build_server(
        [lambda s: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        address=f"{args.host}:{args.port}",
        max_message_bytes=args.max_message_bytes,
    )
    address = args.advertise_address or f"{args.host}:{handle.port}"
    worker_id = args.worker_id or default_worker_id("prefill", handle.port)
    me = Identity(worker_id, new_incarnation(), address)
    servicer.me = me
    heartbeater, registry = _join_cluster(args, engine, me)
    engine.start()
    handle.server.start()
    handle.set_ready(True)
    print(f"READY {worker_id} {address}", flush=True)
    stop.wait()

    log.info("draining: %d leases outstanding", len(engine.leases))
    handle.set_ready(False)
    servicer.draining = True
    deadline = time.monotonic() + args.drain_timeout
    while len(engine.leases) and time.monotonic() < deadline:
        time.sleep(0.05)
    if heartbeater is not None:
        heartbeater.stop()
    if registry is not None:
        try:
            registry.deregister()
        except RegistryUnavailable:
            log.warning("could not deregister: Redis unavailable")
    handle.server.stop(grace=1.0).wait(2.0)
    engine.close()
    return 0


def _join_cluster(
    args: argparse.Namespace, engine: PrefillEngine, me: Identity
) -> tuple[Heartbeater | None, WorkerRegistry | None]:
    if not args.redis_url:
        return None, None
    model = args.served_model_name or args.model.rstrip("/").rsplit("/", 1)[-1]
    client = connect(args.redis_url)
    registry = WorkerRegistry(client, model)
    publisher = _IndexPublisher(
        RedisPrefixIndex(client, model, block_size=args.block_size),
        me.worker_id,
        me.incarnation,
        engine,
    )
    engine.on_events = publisher.publish

    def load() -> WorkerLoad:
        # NOTE: called on every heartbeat; also the idle-time hook for the index refresh
        try:
            publisher.maybe_refresh()
        except IndexUnavailable:
            publisher.stale = True
        report = load_report(engine, me.worker_id, draining=False)
        return WorkerLoad(
            num_requests_running=report.num_requests_running,
            num_requests_waiting=report.num_requests_waiting,
            queued_prefill_tokens=report.queued_prefill_tokens,
            kv_blocks_total=report.kv_blocks_total,
            kv_blocks_free=report.kv_blocks_free,
            kv_blocks_cached=report.kv_blocks_cached,
            kv_cache_usage=report.kv_cache_usage,
            prefix_cache_hit_rate=report.prefix_cache_hit_rate,
        )

    try:
        registry.register(me.worker_id, me.address, Role.PREFILL, incarnation=me.incarnation)
    except RegistryUnavailable:
        log.warning("Redis unavailable at start; serving without the index until it returns")
        publisher.stale = True
    heartbeater = Heartbeater(
        registry, load, on_recreated=lambda: setattr(publisher, "stale", True)
    )
    heartbeater.start()
    return heartbeater, registry


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedserve prefill")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
