"""What the prefill and the decode worker's `server.py` do alike: the process skeleton
(signals, the engine loop on the main thread), the engine config's sizing (engine_sizing.py),
what a dying loop does to health, binding, joining the registry, READY and the drain. Each
`server.py` keeps only what its worker does differently (and sets up its logging, logs.py).

    run(role, stop, start) ── SIGTERM / SIGINT set `stop`
      start(stop, loop)        load the model, build the engine and worker (WorkerHooks)
      serve()  (side thread)   bind ─► join Redis ─► worker.start ─► announce_ready
                               stop.wait ─► NOT_SERVING ─► wait_drained ─► leave, stop
      engine loop (main thread, EngineLoop.serve_on_side_thread)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from pagedserve.cli_options import default_worker_id
from pagedserve.cluster import model_key
from pagedserve.core_share import one_torch_thread
from pagedserve.grpcutil import (
    EngineLoop,
    ServerHandle,
    build_server,
    health_address,
    server_tls_from_args,
)
from pagedserve.kvstore.worker_registry import connect
from pagedserve.model.tp_pipes import RankLost
from pagedserve.signals import stop_on_signals

log = logging.getLogger("pagedserve.worker")
DRAIN_POLL_S = 0.05

Serve = Callable[[], Coroutine[Any, Any, int]]


def run(
    role: str,
    stop: threading.Event | None,
    start: Callable[[threading.Event, EngineLoop], Serve | None],
) -> int:
    """Run a worker process until `stop` (made here, set by SIGTERM / SIGINT, when not given).

    `start(stop, engine_loop)` loads the model and builds the worker on the main thread; it
    returns the coroutine function that serves, or None when `stop` was set meanwhile (after
    releasing what it loaded). That coroutine runs on a side thread's event loop while the
    worker's loop takes the main thread (EngineLoop); its result is the exit status."""
    if stop is None:
        stop = threading.Event()
        stop_on_signals(stop)
    if stop.is_set():  # NOTE: stopped while starting: nothing is loaded yet
        return 0
    engine_loop = EngineLoop(f"{role}-loop", on_main_thread=True)
    serve = start(stop, engine_loop)
    if serve is None:
        return 0
    return engine_loop.serve_on_side_thread(serve, one_torch_thread)


class LoopDeath:
    """A worker's `WorkerHooks.on_loop_death` in a server: health NOT_SERVING once the server
    is bound (`handle`); a lost tensor-parallel rank also stops the worker (it cannot step
    again: exiting lets `pagedserve up` or Kubernetes start it afresh)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.handle: ServerHandle | None = None  # NOTE: set when bound, before the loop starts

    def __call__(self, death: BaseException) -> None:
        if self.handle is not None:
            self.handle.set_ready_threadsafe(False)
        if isinstance(death, RankLost):
            log.error("stopping: %s", death)
            self.stop.set()


@dataclass(frozen=True, slots=True)
class Bound:
    """A bound (not yet started) worker server: where others dial it, and its id."""

    handle: ServerHandle
    address: str
    worker_id: str


async def bind(
    args: argparse.Namespace,
    role: str,
    add_servicers: Sequence[Callable[[Any], None]],
    service_names: Sequence[str],
) -> Bound:
    """Build the server on `--host:--port` (NOT_SERVING until `set_ready(True)`), on the
    running event loop; the address is `--advertise-address` or the bound one, the id
    `--worker-id` or one made of the role, host and port."""
    handle = await build_server(
        add_servicers,
        service_names,
        address=f"{args.host}:{args.port}",
        max_message_bytes=args.max_message_bytes,
        tls=server_tls_from_args(args),
    )
    await handle.add_health_port(health_address(args.host, getattr(args, "health_port", None)))
    address = args.advertise_address or f"{args.host}:{handle.port}"
    worker_id = args.worker_id or default_worker_id(role, handle.port)
    return Bound(handle, address, worker_id)


def connect_registry(args: argparse.Namespace) -> tuple[redis.Redis, str] | None:
    """The Redis client (`--redis-url`) and the model's key in it; None without Redis."""
    if not args.redis_url:
        return None
    return connect(args.redis_url), model_key(args.served_model_name, args.model)


async def announce_ready(bound: Bound, *, ready: bool = True) -> None:
    """Start serving, turn health to `ready`, print `READY <worker_id> <address>` (and log
    it: a worker's log says when it served)."""
    await bound.handle.start()
    await bound.handle.set_ready(ready)
    log.info(
        "serving as %s at %s%s", bound.worker_id, bound.address, "" if ready else " (not ready)"
    )
    print(f"READY {bound.worker_id} {bound.address}", flush=True)


async def wait_drained(in_flight: Callable[[], int], timeout_s: float) -> None:
    """Wait until `in_flight()` is 0, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
