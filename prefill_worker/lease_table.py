"""LeaseTable: the one owner of KV leases on a prefill worker (docs/leases.md).

A lease pins a prefilled request's blocks until the decode worker has pulled them::

    grant ──► ACTIVE ──release──────────► RELEASED   release_fn(lease) called once, here
                │  ▲                                 (or)
                │  └─renew (expiry = max(expiry, now + extend))
                └──expiry passes; reap ──► EXPIRED    release_fn(lease) called once, here

Expiry is absolute and checked against the table's clock: past it, the lease is dead for
``get`` and ``renew`` even before the reaper has run; ``release`` of such a lease still frees it
(once). ``state`` tells an expired handle (remembered, up to ``remember_expired`` of them, most
recent kept) from one that never existed or was released, so a late pull can be told "expired"
(FAILED_PRECONDITION) rather than "unknown" (NOT_FOUND).

The worker wires ``release_fn`` to ``KVCacheManager.free(table)``, so the full blocks go back to
the prefix cache (CACHED, LRU) rather than the free list and a retry still hits.
"""

from __future__ import annotations

import enum
import heapq
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
DEFAULT_REMEMBER_EXPIRED = 4096

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Lease(Generic[T]):
    """A granted lease; a snapshot (``renew`` makes a new one with a later ``expires_at``).

    ``resource`` is what the lease pins (the worker's ``BlockTable``); only ``release_fn`` may
    free it. Times are in the table's clock (monotonic seconds by default).
    """

    handle_id: str
    request_id: str
    resource: T
    granted_at: float
    expires_at: float


class LeaseState(enum.Enum):
    """What the table knows about a handle id now."""

    ACTIVE = "active"  # granted, not released, before its expiry
    EXPIRED = "expired"  # its expiry passed (reaped or not); among the last remembered ones
    UNKNOWN = "unknown"  # never granted here, released, or expired too long ago to remember


@dataclass(frozen=True, slots=True)
class LeaseStats:
    """Counters since start, for ``pagedserve:kv_leases_*`` metrics."""

    granted: int
    released: int
    expired: int
    active: int


class LeaseTable(Generic[T]):
    """Leases by handle id, with an expiry-ordered heap for the reaper.

    Contracts:
    - ``release_fn(lease)`` is called exactly once per granted lease: by the ``release`` or the
      ``reap`` that removes it, never both, never twice (removal happens under one lock; the
      call happens after the lock is dropped, on the caller's thread).
    - ``release_fn`` therefore runs on whichever thread releases or reaps; a pool that is not
      thread-safe must be guarded by the worker (or ``release_fn`` must hand off to its thread).
    - ``now`` arguments default to ``clock()``; tests pass a fake clock.
    """

    def __init__(
        self,
        release_fn: Callable[[Lease[T]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        remember_expired: int = DEFAULT_REMEMBER_EXPIRED,
    ) -> None:
        if remember_expired < 0:
            raise ValueError(f"remember_expired: must be >= 0, got {remember_expired}")
        self._release_fn = release_fn
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease[T]] = {}
        # NOTE: bounded memory of expired handle ids, oldest first (FIFO eviction).
        self._expired_ids: OrderedDict[str, None] = OrderedDict()
        self._remember_expired = remember_expired
        # NOTE: lazy deletion: (expires_at, seq, handle_id) entries outlive renewals and
        # releases; an entry is live only while it matches the lease's current expires_at.
        # seq (a push counter) orders equal expiries by grant/renew time, deterministically.
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0
        self._granted = 0
        self._released = 0
        self._expired = 0

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def __len__(self) -> int:
        """Leases granted and not yet released or reaped (expired ones included until reaped)."""
        with self._lock:
            return len(self._leases)

    def grant(
        self, request_id: str, resource: T, ttl_s: float = DEFAULT_LEASE_S, now: float | None = None
    ) -> Lease[T]:
        """Lease ``resource`` for ``ttl_s`` seconds under a fresh random 128-bit handle id.

        The table takes ownership of ``resource``: it is freed through ``release_fn`` only.
        """
        if not request_id:
            raise ValueError("request_id: must be non-empty")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: must be positive, got {ttl_s}")
        now = self._clock() if now is None else now
        lease = Lease(secrets.token_hex(16), request_id, resource, now, now + ttl_s)
        with self._lock:
            self._leases[lease.handle_id] = lease
            self._push_locked(lease.expires_at, lease.handle_id)
            self._granted += 1
        return lease

    def get(self, handle_id: str, now: float | None = None) -> Lease[T] | None:
        """The lease if it is active at ``now``; None if unknown, released or expired."""
        now = self._clock() if now is None else now
        with self._lock:
            lease = self._leases.get(handle_id)
        return lease if lease is not None and now < lease.expires_at else None

    def state(self, handle_id: str, now: float | None = None) -> LeaseState:
        """ACTIVE, EXPIRED (past its expiry, reaped or not) or UNKNOWN (see ``LeaseState``)."""
        now = self._clock() if now is None else now
        with self._lock:
            lease = self._leases.get(handle_id)
            if lease is not None:
                return LeaseState.ACTIVE if now < lease.expires_at else LeaseState.EXPIRED
            return LeaseState.EXPIRED if handle_id in self._expired_ids else LeaseState.UNKNOWN

    def renew(self, handle_id: str, extend_s: float, now: float | None = None) -> float | None:
        """Extend an active lease to ``max(expires_at, now + extend_s)``; the new expiry.

        None if the lease is unknown, released or already expired (an expired lease cannot
        come back: its blocks may be reaped at any moment).
        """
        if not extend_s > 0:
            raise ValueError(f"extend_s: must be positive, got {extend_s}")
        now = self._clock() if now is None else now
        with self._lock:
            lease = self._leases.get(handle_id)
            if lease is None or now >= lease.expires_at:
                return None
            new_expiry = max(lease.expires_at, now + extend_s)
            if new_expiry > lease.expires_at:
                self._leases[handle_id] = replace(lease, expires_at=new_expiry)
                self._push_locked(new_expiry, handle_id)
                self._compact_locked()
            return new_expiry

    def release(self, handle_id: str, now: float | None = None) -> bool:
        """Free the lease now (idempotent); True if this call freed it.

        A lease already past its expiry is still freed here (once), and ``state`` keeps calling
        it EXPIRED: whoever pulls it late learns it expired, not that it never existed.
        """
        now = self._clock() if now is None else now
        with self._lock:
            lease = self._leases.pop(handle_id, None)
            if lease is None:
                return False
            self._released += 1
            if now >= lease.expires_at:
                self._remember_expired_locked(handle_id)
        self._release_fn(lease)
        return True

    def release_request(self, request_id: str, now: float | None = None) -> int:
        """Free every lease granted to ``request_id``, each as ``release`` does; how many this
        call freed. For a caller that gave the request up without learning its handle.

        NOTE: a scan of the active leases: only an abort whose answer was lost takes this path.
        """
        with self._lock:
            ids = [h for h, lease in self._leases.items() if lease.request_id == request_id]
        return sum(self.release(handle_id, now) for handle_id in ids)

    def reap(self, now: float | None = None) -> list[Lease[T]]:
        """Free every lease expired at ``now`` (``expires_at <= now``), earliest expiry first
        (equal expiries in the order they were granted or last renewed).

        Returns the reaped leases. If a ``release_fn`` call raises, the others still run and
        the first error is re-raised afterwards.
        """
        now = self._clock() if now is None else now
        reaped: list[Lease[T]] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                expires_at, _, handle_id = heapq.heappop(self._heap)
                lease = self._leases.get(handle_id)
                if lease is None or lease.expires_at != expires_at:
                    continue  # released, or renewed past this entry
                del self._leases[handle_id]
                self._remember_expired_locked(handle_id)
                reaped.append(lease)
            self._expired += len(reaped)
        self._release_all(reaped)
        return reaped

    def next_expiry(self) -> float | None:
        """Earliest ``expires_at`` among active leases, or None (the reaper sleeps until it)."""
        with self._lock:
            while self._heap:
                expires_at, _, handle_id = self._heap[0]
                lease = self._leases.get(handle_id)
                if lease is not None and lease.expires_at == expires_at:
                    return expires_at
                heapq.heappop(self._heap)
        return None

    def stats(self) -> LeaseStats:
        with self._lock:
            return LeaseStats(self._granted, self._released, self._expired, len(self._leases))

    def _release_all(self, leases: list[Lease[T]]) -> None:
        first_error: Exception | None = None
        for lease in leases:
            try:
                self._release_fn(lease)
            except Exception as e:
                logger.exception("release_fn failed for lease %s", lease.handle_id)
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def _remember_expired_locked(self, handle_id: str) -> None:
        if self._remember_expired == 0:
            return
        self._expired_ids[handle_id] = None
        while len(self._expired_ids) > self._remember_expired:
            self._expired_ids.popitem(last=False)

    def _push_locked(self, expires_at: float, handle_id: str) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (expires_at, self._seq, handle_id))

    def _compact_locked(self) -> None:
        # NOTE: renewals push new heap entries; rebuild when dead entries dominate.
        if len(self._heap) > 2 * len(self._leases) + 64:
            live = {h: lease.expires_at for h, lease in self._leases.items()}
            self._heap = [e for e in self._heap if live.get(e[2]) == e[0]]
            heapq.heapify(self._heap)


class LeaseReaper:
    """A daemon thread that reaps ``table`` at each lease's expiry (or every ``max_wait_s``).

    ``stop`` returns within its timeout: the thread only ever sleeps on an event. Errors from
    ``release_fn`` are logged and the thread keeps reaping.
    """

    def __init__(self, table: LeaseTable[T], *, max_wait_s: float = 0.25) -> None:
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s: must be positive, got {max_wait_s}")
        self._table = table
        self._max_wait_s = max_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Ask the thread to end and wait at most ``timeout_s``; True if it has ended."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._wait_s()):
            try:
                self._table.reap()
            except Exception:
                # NOTE: already logged per lease by the table; a reaper must outlive one failure.
                logger.warning("lease reaper: a release_fn failed; continuing")

    def _wait_s(self) -> float:
        next_expiry = self._table.next_expiry()
        if next_expiry is None:
            return self._max_wait_s
        return min(self._max_wait_s, max(0.0, next_expiry - self._table.clock()))
