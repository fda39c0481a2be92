"""`IndexPublisher`: mirrors a worker's block events into the Redis prefix index.

Both workers use it (docs/prefix_index.md): a prefill worker for the prompts it computes, a
decode worker for the blocks it computes (prompts prefilled there, generated tokens) or imports.
It knows a worker only through `HashSource` (the hashes its pool and its host and disk tiers can
serve now, with their tiers), so kvstore imports no service.

Threads: the worker's loop calls `submit` after every step and never waits for Redis; one
publisher thread writes what was submitted, in order; the heartbeat thread calls `refresh`.
One lock orders the publisher thread's writes and the heartbeat's refreshes, so a refresh
snapshot never re-adds a hash whose REMOVED was already written.

Degradation (the index is a hint, prefix_index.md): a failed write marks the index *stale*, counts
the events it dropped and remembers the REMOVED hashes among them (bounded). The next write that
gets through first deletes those hashes, then re-asserts every hash the worker holds. Entries are
also re-asserted every `refresh_interval_s` (half the entry TTL), because prefix hits keep
blocks hot without producing events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind, Tier
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.prefix_index import IndexUnavailable, PrefixIndex

log = logging.getLogger(__name__)

MAX_REMOVED_WHILE_STALE = 1 << 16
DEFAULT_REFRESH_INTERVAL_S = 300.0


class HashSource(Protocol):
    """A worker whose pool's hashes are published (`PrefillWorker`, `DecodeWorker`)."""

    def registered_hashes(self) -> Mapping[BlockHash, Tier]:
        """Every hash the worker can serve a prefix hit for now, with the tier holding it
        (device pool, host or disk tier; thread-safe)."""


@dataclass(slots=True)
class IndexEvents:
    """A worker's `on_events`: to the index publisher once the worker has joined Redis;
    dropped before that, and without Redis (nothing to publish to)."""

    publisher: IndexPublisher | None = None

    def submit(self, events: list[BlockEvent]) -> None:
        if self.publisher is not None:
            self.publisher.submit(events)


class IndexPublisher:
    """Publishes one worker incarnation's block events; see the module docstring."""

    def __init__(
        self,
        index: PrefixIndex,
        worker_id: str,
        incarnation: str,
        worker: HashSource,
        *,
        refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S,
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.worker = worker
        self.refresh_interval_s = refresh_interval_s
        self.stale = False
        self.dropped_events = 0
        self._last_refresh = time.monotonic()
        self._removed_while_stale: set[BlockHash] = set()
        self._lock = threading.Lock()  # Redis writes
        self._cond = threading.Condition()  # the queue below
        self._queue: list[BlockEvent] = []
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="index-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (best effort), then end the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def submit(self, events: list[BlockEvent]) -> None:
        """Queue events for the publisher thread (the worker's `on_events`); never blocks."""
        with self._cond:
            self._queue.extend(events)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far was written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def publish(self, events: list[BlockEvent]) -> None:
        """Write `events` now (refreshing first if stale or due); never raises for Redis."""
        with self._lock:
            try:
                self._refresh_locked(force=False)
                self.index.publish(self.worker_id, events, incarnation=self.incarnation)
            except IndexUnavailable:
                self._mark_stale_locked(events)

    def refresh(self, *, force: bool = False) -> None:
        """Republish if stale, due or forced (the worker record was re-created)."""
        with self._lock:
            try:
                self._refresh_locked(force=force)
            except IndexUnavailable:
                self._mark_stale_locked([])

    def clear(self) -> None:
        """Delete this worker's entries (shutdown). Raises IndexUnavailable."""
        with self._lock:
            self.index.clear(self.worker_id, self.worker.registered_hashes())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                events, self._queue = self._queue, []
                self._busy = True
            try:
                self.publish(events)
            except Exception:
                log.exception("index publisher: unexpected error; %d events lost", len(events))
                self.stale = True
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _mark_stale_locked(self, events: list[BlockEvent]) -> None:
        if not self.stale:
            log.warning("prefix index unavailable: publishes dropped until Redis answers")
        self.stale = True
        self.dropped_events += len(events)
        for event in events:
            removed = event.kind is BlockEventKind.REMOVED
            if removed and len(self._removed_while_stale) < MAX_REMOVED_WHILE_STALE:
                self._removed_while_stale.add(event.block_hash)

    def _refresh_locked(self, *, force: bool) -> None:
        due = time.monotonic() - self._last_refresh > self.refresh_interval_s
        if not (force or self.stale or due):
            return
        hashes = self.worker.registered_hashes()
        gone = self._removed_while_stale.difference(hashes.keys())
        if gone:
            removed = [BlockEvent(BlockEventKind.REMOVED, h) for h in gone]
            self.index.publish(self.worker_id, removed, incarnation=self.incarnation)
        self.index.refresh(self.worker_id, hashes, incarnation=self.incarnation)
        if self.stale:
            log.info("prefix index republished: %d hashes, %d removals", len(hashes), len(gone))
        self._removed_while_stale.clear()
        self.stale = False
        self._last_refresh = time.monotonic()
