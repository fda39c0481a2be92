"""WorkerRegistry: who is alive in the cluster, where, with which load (docs/prefix_index.md).

Torch-free: the router reads it to build its load view. Redis layout (prefix ``ps:{model}:``)::

    worker:{id}   hash  address, role, incarnation, started_at (unix ms),
                        heartbeat_at (unix ms), load (JSON of WorkerLoad),
                        compat (``compat_tag``: what block hashes and KV layout depend on)
                        key PX = ttl, renewed by every heartbeat
    workers       set   worker ids that registered; a hint only (see below)

The ``worker:{id}`` key is the truth: a worker is alive while its key exists, and a given
*incarnation* (a random id drawn once per process start) is alive while the key exists and holds
that incarnation. The ``workers`` set only lets ``live_workers`` find the keys without ``SCAN``
(which walks the whole keyspace, millions of ``blk:`` keys in a busy cluster). Members whose key
has expired are removed lazily by ``live_workers``; every heartbeat re-adds its own id, so a
member removed by a reader racing a re-registration comes back within one heartbeat.

Every Redis failure surfaces as ``RegistryUnavailable``; the caller decides how to degrade.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.typing import EncodableT, FieldT

from pagedserve.worker_load import Role, WorkerLoad  # NOTE: part of this module's API too

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.5
"""Socket connect/read timeout of the Redis clients made by ``connect``."""
DEFAULT_WORKER_TTL_S = 9.0
"""How long a worker record lives without a heartbeat."""
INCARNATION_FIELD = "incarnation"

_REDIS_ERRORS = (redis.RedisError, OSError)

# NOTE: compare-and-delete, so that a late deregister of an old incarnation never removes the
# record of a newer process that registered under the same worker id.
_DEREGISTER_LUA = """
if redis.call('HGET', KEYS[1], 'incarnation') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


class RegistryUnavailable(Exception):
    """Redis could not be reached or answered with an error; the registry state is unknown."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker record as stored under ``worker:{id}``."""

    worker_id: str
    address: str
    role: Role
    incarnation: str
    started_at_ms: int
    load: WorkerLoad = field(default_factory=WorkerLoad)
    compat: str = ""  # `compat_tag` of the worker; "" when it did not say (older workers)


def compat_tag(model_fingerprint: bytes, block_size: int) -> str:
    """What must match between a router and its workers for block hashes to agree: the model
    fingerprint (config, dtype, revision) and the block size."""
    return f"{model_fingerprint.hex()}/{block_size}"


def key_prefix(model: str) -> str:
    """The Redis key prefix ``ps:{model}:`` of one served model. ``model`` names the model."""
    if not model or any(c.isspace() for c in model) or ":" in model:
        raise ValueError(f"model: must be non-empty, without whitespace or ':', got {model!r}")
    return f"ps:{model}:"


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}worker:{worker_id}"


def workers_set_key(prefix: str) -> str:
    return f"{prefix}workers"


def new_incarnation() -> str:
    """A fresh random incarnation id (64 bits, hex); draw one per process start."""
    return secrets.token_hex(8)


def connect(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> redis.Redis:
    """A Redis client that fails fast: short socket timeouts and no retries.

    NOTE: redis-py's default retry policy backs off for seconds; a hint store must not stall a
    request, so a failed command raises at once and the next command reconnects.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be positive, got {timeout_s}")
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def check_worker_id(worker_id: str) -> None:
    """ValueError unless ``worker_id`` is non-empty and has no whitespace."""
    if not worker_id or any(c.isspace() for c in worker_id):
        raise ValueError(f"worker_id: must be non-empty without whitespace, got {worker_id!r}")


def _now_ms() -> int:
    return int(time.time() * 1000)


class WorkerRegistry:
    """Reads the worker records of one model; registers and heartbeats at most one of them.

    Contracts:
    - ``register`` makes this instance the owner of one record; ``heartbeat`` and ``deregister``
      act on it. Reading (``live_workers``, ``is_alive``, ``get``) needs no registration.
    - ``heartbeat`` rewrites the whole record, so it also re-creates a record lost to a Redis
      restart or an expired TTL, and says so (the caller must then republish its index entries).
    - Thread-safe (redis-py clients are); every Redis failure raises ``RegistryUnavailable``.
    """

    def __init__(
        self, client: redis.Redis, model: str, *, ttl_s: float = DEFAULT_WORKER_TTL_S
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be positive, got {ttl_s}")
        self._client = client
        self._prefix = key_prefix(model)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._me: WorkerInfo | None = None
        self._deregister = client.register_script(_DEREGISTER_LUA)

    @property
    def ttl_s(self) -> float:
        return self._ttl_ms / 1000

    @property
    def me(self) -> WorkerInfo | None:
        """The record this instance registered (last written load included), or None."""
        return self._me

    # -- owner side ----------------------------------------------------------------------------

    def register(
        self,
        worker_id: str,
        address: str,
        role: Role,
        *,
        incarnation: str | None = None,
        load: WorkerLoad | None = None,
        compat: str = "",
    ) -> WorkerInfo:
        """Write this process's record (a fresh incarnation unless given) and return it.

        The identity is kept even when the write fails (``RegistryUnavailable`` is raised), so a
        later ``heartbeat`` registers as soon as Redis answers.
        """
        check_worker_id(worker_id)
        if not address:
            raise ValueError("address: must be non-empty (host:port)")
        self._me = WorkerInfo(
            worker_id=worker_id,
            address=address,
            role=role,
            incarnation=incarnation or new_incarnation(),
            started_at_ms=_now_ms(),
            load=load or WorkerLoad(),
            compat=compat,
        )
        self._write(self._me)
        return self._me

    def heartbeat(self, load: WorkerLoad | None = None) -> bool:
        """Renew the record's TTL (and its load, if given); True if it had to be re-created.

        RuntimeError before ``register``.
        """
        me = self._require_me()
        if load is not None:
            me = self._me = dataclasses.replace(me, load=load)
        return self._write(me)

    def deregister(self) -> bool:
        """Delete this incarnation's record; True if it was there. A newer one is left alone."""
        me = self._require_me()
        keys = [worker_key(self._prefix, me.worker_id), workers_set_key(self._prefix)]
        try:
            return bool(self._deregister(keys=keys, args=[me.incarnation, me.worker_id]))
        except _REDIS_ERRORS as e:
            raise RegistryUnavailable(f"deregister {me.worker_id}: {e}") from e

    # -- reader side ---------------------------------------------------------------------------

    def live_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Every worker whose record exists now (optionally of one role), by worker id."""
        set_key = workers_set_key(self._prefix)
        try:
            members = cast(set[bytes], self._client.smembers(set_key))
            ids = sorted(m.decode() for m in members)
            pipe = self._client.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hgetall(worker_key(self._prefix, worker_id))
            records = pipe.execute()
            gone = [w for w, rec in zip(ids, records, strict=True) if not rec]
            if gone:
                self._client.srem(set_key, *gone)
        except _REDIS_ERRORS as e:
            raise RegistryUnavailable(f"live_workers: {e}") from e
        infos = [
            info
            for worker_id, rec in zip(ids, records, strict=True)
            if rec and (info := self._parse(worker_id, rec)) is not None
        ]
        return [i for i in infos if role is None or i.role == role]

    def get(self, worker_id: str) -> WorkerInfo | None:
        """The record of ``worker_id`` if it is alive, else None."""
        try:
            key = worker_key(self._prefix, worker_id)
            rec = cast(dict[bytes, bytes], self._client.hgetall(key))
        except _REDIS_ERRORS as e:
            raise RegistryUnavailable(f"get {worker_id}: {e}") from e
        return self._parse(worker_id, rec) if rec else None

    def is_alive(self, worker_id: str, incarnation: str) -> bool:
        """Whether ``worker_id`` is registered now with exactly this ``incarnation``."""
        return self.live_incarnations([worker_id]).get(worker_id) == incarnation

    def live_incarnations(self, worker_ids: Collection[str]) -> Mapping[str, str]:
        """``worker_id -> incarnation`` for each of ``worker_ids`` alive now (one round trip)."""
        ids = list(worker_ids)
        try:
            pipe = self._client.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hget(worker_key(self._prefix, worker_id), INCARNATION_FIELD)
            values = pipe.execute()
        except _REDIS_ERRORS as e:
            raise RegistryUnavailable(f"live_incarnations: {e}") from e
        return {w: v.decode() for w, v in zip(ids, values, strict=True) if v is not None}

    # -- internals -----------------------------------------------------------------------------

    def _require_me(self) -> WorkerInfo:
        if self._me is None:
            raise RuntimeError("WorkerRegistry: register() must be called first")
        return self._me

    def _write(self, info: WorkerInfo) -> bool:
        key = worker_key(self._prefix, info.worker_id)
        mapping: dict[FieldT, EncodableT] = {
            "address": info.address,
            "role": info.role.value,
            INCARNATION_FIELD: info.incarnation,
            "started_at": str(info.started_at_ms),
            "heartbeat_at": str(_now_ms()),
            "load": info.load.to_json(),
            "compat": info.compat,
        }
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(key)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, self._ttl_ms)
            pipe.sadd(workers_set_key(self._prefix), info.worker_id)
            existed, *_ = pipe.execute()
        except _REDIS_ERRORS as e:
            raise RegistryUnavailable(f"write {info.worker_id}: {e}") from e
        return not existed

    def _parse(self, worker_id: str, rec: Mapping[bytes, bytes]) -> WorkerInfo | None:
        try:
            return WorkerInfo(
                worker_id=worker_id,
                address=rec[b"address"].decode(),
                role=Role(rec[b"role"].decode()),
                incarnation=rec[INCARNATION_FIELD.encode()].decode(),
                started_at_ms=int(rec[b"started_at"]),
                load=WorkerLoad.from_json(rec.get(b"load", b"{}")),
                compat=rec.get(b"compat", b"").decode(),
            )
        except (KeyError, ValueError, TypeError) as e:
            # NOTE: a half-written or foreign record; treat the worker as not routable.
            logger.warning("worker registry: malformed record for %s: %r", worker_id, e)
            return None


class Heartbeater:
    """A daemon thread that calls ``registry.heartbeat(load_fn())`` every ``interval_s``.

    Failures (``RegistryUnavailable``) are logged and counted, never fatal: the next beat
    retries and re-creates the record when Redis is back, then calls ``on_recreated`` (republish
    the prefix index there). ``stop`` returns within ``timeout_s``: one beat is bounded by the
    client's socket timeout.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        load_fn: Callable[[], WorkerLoad],
        *,
        interval_s: float | None = None,
        on_recreated: Callable[[], None] | None = None,
    ) -> None:
        self._registry = registry
        self._load_fn = load_fn
        self._interval_s = registry.ttl_s / 3 if interval_s is None else interval_s
        if self._interval_s <= 0:
            raise ValueError(f"interval_s: must be positive, got {interval_s}")
        self._on_recreated = on_recreated
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.beats = 0
        self.failures = 0
        self.recreations = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Ask the thread to end and wait at most ``timeout_s``; True if it has ended."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def beat_once(self) -> None:
        """One heartbeat, as the thread does it (exposed for tests and for a first beat)."""
        try:
            recreated = self._registry.heartbeat(self._load_fn())
        except RegistryUnavailable as e:
            self.failures += 1
            logger.warning("heartbeat failed (%d so far): %s", self.failures, e)
            return
        self.beats += 1
        if recreated:
            self.recreations += 1
            logger.info("worker record re-created in Redis")
            if self._on_recreated is not None:
                self._on_recreated()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.beat_once()
            except Exception:
                # NOTE: a background thread has no caller to raise to; keep beating.
                logger.exception("heartbeat: on_recreated or load_fn failed")
