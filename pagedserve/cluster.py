"""Joining the cluster (docs/prefix_index.md): the one join-the-cluster code of both workers.

A worker joins with its id, address, role and this process's incarnation: its record goes into
the Redis registry (``worker:{id}``) and a heartbeat thread keeps it alive, carrying the load the
worker's callback reports. Leaving stops the heartbeat and deletes the record (this incarnation's
only). Redis is a hint: a worker whose Redis is unavailable at start serves anyway, and its
heartbeat registers it as soon as Redis answers (``on_recreated`` is then called).

A worker that publishes its blocks to the prefix index joins with ``join_indexed``: the same
membership plus an ``IndexPublisher`` that the heartbeat refreshes (every TTL/2 of the index
entries, and at once after a re-created record), cleared before the record goes.

Torch-free; imports no service package (a worker passes callbacks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis

from pagedserve.kvstore.index_publisher import HashSource, IndexEvents, IndexPublisher
from pagedserve.kvstore.prefix_index import IndexUnavailable, RedisPrefixIndex
from pagedserve.kvstore.worker_registry import (
    DEFAULT_WORKER_TTL_S,
    Heartbeater,
    RegistryUnavailable,
    Role,
    WorkerLoad,
    WorkerRegistry,
    new_incarnation,
)

log = logging.getLogger(__name__)


def model_key(served_model_name: str | None, model_dir: str) -> str:
    """The model's name in Redis keys: ``--served-model-name``, else the model folder's name."""
    return served_model_name or model_dir.rstrip("/").rsplit("/", 1)[-1]


class ClusterMember:
    """This process's membership: its registry record and the heartbeat that keeps it alive.

    Made by ``join``. ``registered`` says whether the record was written at start (False: Redis
    was unavailable; the heartbeat writes it when Redis returns).
    """

    def __init__(self, registry: WorkerRegistry, heartbeater: Heartbeater, registered: bool):
        self.registry = registry
        self.heartbeater = heartbeater
        self.registered = registered

    def leave(self, before_deregister: Callable[[], None] | None = None) -> None:
        """Stop the heartbeat, call ``before_deregister`` (delete what points at this
        incarnation, e.g. index entries), then delete the record. Best effort: a Redis failure
        is logged, and the rest is skipped (the record expires with its TTL)."""
        self.heartbeater.stop()
        try:
            if before_deregister is not None:
                before_deregister()
            self.registry.deregister()
        except (IndexUnavailable, RegistryUnavailable):
            log.warning("could not leave the cluster cleanly: Redis unavailable")


# NOTE: the registry record's fields, each named at the one call site per worker kind.
def join(  # noqa: PLR0913
    client: redis.Redis,
    model: str,
    worker_id: str,
    address: str,
    role: Role,
    load: Callable[[], WorkerLoad],
    *,
    compat: str,
    incarnation: str | None = None,
    ttl_s: float = DEFAULT_WORKER_TTL_S,
    heartbeat_interval_s: float | None = None,
    on_recreated: Callable[[], None] | None = None,
) -> ClusterMember:
    """Register ``worker_id`` in the registry of ``model`` on ``client`` (a
    ``worker_registry.connect`` client), under ``incarnation`` (a fresh one if None), and
    start its heartbeat: every ``heartbeat_interval_s`` (default: a third of ``ttl_s``) it
    sends ``load()`` and, if it had to re-create the record, calls ``on_recreated`` (republish
    the index there).
    """
    registry = WorkerRegistry(client, model, ttl_s=ttl_s)
    try:
        registry.register(
            worker_id,
            address,
            role,
            incarnation=incarnation or new_incarnation(),
            compat=compat,
        )
        registered = True
    except RegistryUnavailable:
        log.warning("Redis unavailable at start; the heartbeat registers when it returns")
        registered = False
    heartbeater = Heartbeater(
        registry, load, interval_s=heartbeat_interval_s, on_recreated=on_recreated
    )
    heartbeater.start()
    return ClusterMember(registry, heartbeater, registered)


@dataclass(slots=True)
class IndexedMember:
    """A worker's membership and its index entries (made by ``join_indexed``)."""

    member: ClusterMember
    publisher: IndexPublisher

    def leave(self) -> None:
        """Stop beating and publishing, delete the index entries, then the record (best
        effort). NOTE: events submitted after this are never written."""
        self.member.leave(before_deregister=self._clear_index)

    def _clear_index(self) -> None:
        self.publisher.stop()
        self.publisher.clear()


def join_indexed(  # noqa: PLR0913
    client: redis.Redis,
    model: str,
    worker_id: str,
    address: str,
    role: Role,
    load: Callable[[], WorkerLoad],
    worker: HashSource,
    events: IndexEvents,
    *,
    compat: str,
    incarnation: str,
    block_size: int,
    ttl_s: float = DEFAULT_WORKER_TTL_S,
    heartbeat_interval_s: float | None = None,
) -> IndexedMember:
    """``join``, and publish ``worker``'s block events (``events`` is its ``on_events``; it
    forwards to the publisher from now on) to the Redis prefix index under ``incarnation``.

    The heartbeat's load callback also refreshes the index when due (or stale), and a
    re-created record (Redis lost our keys) republishes every hash at once, as does joining
    (what the worker held before, e.g. a disk tier's blocks after a restart).
    """
    publisher = IndexPublisher(
        RedisPrefixIndex(client, model, block_size=block_size), worker_id, incarnation, worker
    )
    events.publisher = publisher
    publisher.start()

    def load_and_refresh() -> WorkerLoad:
        # NOTE: called on every heartbeat; also the idle-time hook for the index refresh
        publisher.refresh()
        return load()

    member = join(
        client, model, worker_id, address, role, load_and_refresh,
        compat=compat,
        incarnation=incarnation,
        ttl_s=ttl_s,
        heartbeat_interval_s=heartbeat_interval_s,
        on_recreated=lambda: publisher.refresh(force=True),
    )  # fmt: skip
    if not member.registered:
        log.warning("serving without the prefix index until Redis returns")
        publisher.stale = True
    else:
        # NOTE: what the worker holds before it joined (a disk tier's blocks after a restart,
        # warm-up prompts) produced no event the publisher saw.
        publisher.refresh(force=True)
    return IndexedMember(member, publisher)
