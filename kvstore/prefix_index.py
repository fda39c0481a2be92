"""PrefixIndex: which worker holds which block hash, cluster-wide (docs/prefix_index.md).

Torch-free: the router imports this module (``docs/prefix_index.md`` tells the whole story).
Two implementations behind one interface:

- ``RedisPrefixIndex``: the shared index. Keys (prefix ``ps:{model}:``)::

      blk:{hash_hex}  hash  field {worker_id} = "{tier}:{incarnation}"   key PX = entry TTL,
                                                                         refreshed on publish
      events          stream (optional, XADD MAXLEN ~ N) of vLLM-shaped KV event batches

- ``LocalPrefixIndex``: an in-process dict with the same semantics, for single-process runs and
  tests.

The index is a *hint*: a hit only makes a worker cheaper to route to; the worker's own pool is
the truth. An entry counts only while its worker is alive **with the incarnation that wrote
it** (the index asks a ``Liveness``: the registry's ``live_incarnations``); other entries are
ignored by ``lookup`` and deleted lazily. Every Redis failure raises ``IndexUnavailable`` so the
router can fall back to load-only routing and a worker can drop (and count) a publish.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import redis
from redis.typing import EncodableT, FieldT

from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind, Tier
from pagedserve.kvstore.hashing import BLOCK_HASH_BYTES, BlockHash
from pagedserve.kvstore.worker_registry import (
    RegistryUnavailable,
    WorkerRegistry,
    check_worker_id,
    key_prefix,
)

DEFAULT_ENTRY_TTL_S = 600.0
"""Life of a ``blk:`` key after its last publish; a worker re-publishes what it still holds."""
DEFAULT_FIRST_CHUNK = 16
DEFAULT_MAX_CHUNK = 256
DEFAULT_EVENTS_MAXLEN = 100_000

STORED = "BlockStored"
REMOVED = "BlockRemoved"
ALL_CLEARED = "AllBlocksCleared"

_REDIS_ERRORS = (redis.RedisError, OSError)

# NOTE: delete a field only if it still holds the stale value we read, so that lazy cleanup
# racing a fresh publish of the same (hash, worker) never deletes the fresh entry.
# KEYS = blk keys; ARGV = field_1, value_1, field_2, value_2, ...
_CLEANUP_LUA = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, ARGV[2 * i - 1]) == ARGV[2 * i] then
    n = n + redis.call('HDEL', key, ARGV[2 * i - 1])
  end
end
return n
"""


class IndexUnavailable(Exception):
    """The index could not be read or written (Redis down, timed out or erroring)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One worker's claim on one block hash."""

    tier: Tier
    incarnation: str

    def encode(self) -> str:
        return f"{self.tier.value}:{self.incarnation}"

    @classmethod
    def decode(cls, value: str | bytes) -> Entry | None:
        """Parse ``encode`` output; None for a malformed value (treated as stale)."""
        text = value.decode() if isinstance(value, bytes) else value
        tier, sep, incarnation = text.partition(":")
        if not sep or not incarnation or tier not in _TIERS:
            return None
        return cls(Tier(tier), incarnation)


_TIERS = {t.value for t in Tier}


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One ``events`` stream entry: what one worker published in one call, vLLM's shape.

    ``events`` holds dicts like vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
    (``type`` is the tag; ``block_hashes`` are hex strings; fields we do not know are null).
    """

    stream_id: str
    ts: float
    worker_id: str
    incarnation: str
    events: list[dict[str, object]]


@dataclass(slots=True)
class IndexStats:
    """Counters for metrics (``pagedserve:prefix_index_*``); read without locking."""

    lookups: int = 0
    lookup_errors: int = 0
    publishes: int = 0
    publish_errors: int = 0
    stale_entries_cleaned: int = 0


class Liveness(Protocol):
    """Answers which incarnation of each worker is alive (``WorkerRegistry``, or a fake)."""

    def live_incarnations(self, worker_ids: Collection[str]) -> Mapping[str, str]:
        """``worker_id -> incarnation`` for each of ``worker_ids`` alive now; absent = dead."""


class StaticLiveness:
    """A liveness table set by hand (single process without Redis, and tests)."""

    def __init__(self, alive: Mapping[str, str] | None = None) -> None:
        self._alive = dict(alive or {})
        self._lock = threading.Lock()

    def set_alive(self, worker_id: str, incarnation: str) -> None:
        with self._lock:
            self._alive[worker_id] = incarnation

    def set_dead(self, worker_id: str) -> None:
        with self._lock:
            self._alive.pop(worker_id, None)

    def live_incarnations(self, worker_ids: Collection[str]) -> Mapping[str, str]:
        with self._lock:
            return {w: self._alive[w] for w in worker_ids if w in self._alive}


class PrefixIndex(ABC):
    """Maps block hashes to the workers holding them; ``lookup`` scores a prompt per worker.

    Contracts:
    - ``publish`` mirrors one worker's ``BlockPool.drain_events()`` in order: STORED adds (or
      refreshes) the worker's entry, REMOVED deletes it. Events are not retained on failure:
      the caller counts the loss and calls ``refresh`` with its cached hashes later.
    - ``lookup`` never writes an entry; it may delete entries of dead incarnations.
    - Thread-safe. Every failure of the backing store (or of ``liveness``) raises
      ``IndexUnavailable``.
    """

    def __init__(self, liveness: Liveness, *, first_chunk: int, max_chunk: int) -> None:
        if first_chunk <= 0 or max_chunk < first_chunk:
            raise ValueError(
                f"first_chunk/max_chunk: need 0 < first_chunk <= max_chunk, got "
                f"{first_chunk}/{max_chunk}"
            )
        self._first_chunk = first_chunk
        self._max_chunk = max_chunk
        self._liveness = liveness
        self.stats = IndexStats()

    # -- writer side ---------------------------------------------------------------------------

    def publish(self, worker_id: str, events: Iterable[BlockEvent], *, incarnation: str) -> None:
        """Apply one worker's block events (oldest first) under ``incarnation``; a STORED
        event's entry carries the event's tier (``dev``, ``host`` or ``disk``)."""
        check_worker_id(worker_id)
        _check_incarnation(incarnation)
        batch = list(events)
        if not batch:
            return
        try:
            self._apply(worker_id, incarnation, batch)
        except IndexUnavailable:
            self.stats.publish_errors += 1
            raise
        self.stats.publishes += 1

    def refresh(
        self,
        worker_id: str,
        block_hashes: Iterable[BlockHash] | Mapping[BlockHash, Tier],
        *,
        incarnation: str,
        tier: Tier = Tier.DEV,
    ) -> None:
        """Re-assert entries the worker still holds (after a Redis loss, or within the TTL):
        each hash in its tier when ``block_hashes`` maps hashes to tiers, else in ``tier``.

        Same as publishing STORED events, except that nothing goes to the ``events`` stream.
        """
        check_worker_id(worker_id)
        _check_incarnation(incarnation)
        if isinstance(block_hashes, Mapping):
            events = [BlockEvent(BlockEventKind.STORED, h, t) for h, t in block_hashes.items()]
        else:
            events = [BlockEvent(BlockEventKind.STORED, h, tier) for h in block_hashes]
        if events:
            self._apply(worker_id, incarnation, events, record=False)

    @abstractmethod
    def clear(self, worker_id: str, block_hashes: Iterable[BlockHash] = ()) -> None:
        """The worker dropped everything (AllBlocksCleared): delete its entries for
        ``block_hashes``. Entries not named stay until their TTL, ignored once the worker's
        incarnation is dead, so deregistering is what makes a shutdown take effect at once."""

    @abstractmethod
    def _apply(
        self, worker_id: str, incarnation: str, events: list[BlockEvent], *, record: bool = True
    ) -> None: ...

    # -- reader side ---------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """``worker_id -> number of leading blocks of the chain it holds`` (live entries only).

        Workers holding no leading block are absent. Reads the chain in chunks of
        ``first_chunk``, doubling up to ``max_chunk`` blocks (one pipelined round trip each,
        plus one for liveness when a chunk names new workers), and stops after the first chunk
        in which no worker still holds every block so far, i.e. at the first miss. Any read
        past the miss is at most one chunk, and a long hit takes O(log n) round trips.
        """
        try:
            result = self._lookup(block_hashes)
        except IndexUnavailable:
            self.stats.lookup_errors += 1
            raise
        self.stats.lookups += 1
        return result

    def holders(self, block_hash: BlockHash) -> dict[str, Tier]:
        """Live workers holding ``block_hash`` and the tier each holds it in."""
        (raw,) = self._fetch([block_hash])
        live = self._live(raw.keys())
        return {w: e.tier for w, e in raw.items() if e is not None and live.get(w) == e.incarnation}

    def _lookup(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        result: dict[str, int] = {}
        running: set[str] | None = None  # workers holding every block so far
        live: dict[str, str] = {}
        stale: list[tuple[BlockHash, str, Entry | None]] = []
        pos, size = 0, self._first_chunk
        while pos < len(block_hashes) and running != set():
            chunk = block_hashes[pos : pos + size]
            raw = self._fetch(chunk)
            new = {w for entries in raw for w in entries} - live.keys()
            if new:
                found = self._live(new)
                live.update({w: found.get(w, "") for w in new})
            for offset, entries in enumerate(raw):
                holders = set()
                for worker_id, entry in entries.items():
                    if entry is not None and live[worker_id] == entry.incarnation:
                        holders.add(worker_id)
                    else:
                        stale.append((chunk[offset], worker_id, entry))
                if running != set():
                    running = holders if running is None else running & holders
                    for worker_id in running:
                        result[worker_id] = pos + offset + 1
            pos += len(chunk)
            size = min(2 * size, self._max_chunk)
        if stale:
            self.stats.stale_entries_cleaned += self._forget(stale)
        return result

    @abstractmethod
    def _fetch(self, block_hashes: Sequence[BlockHash]) -> list[dict[str, Entry | None]]:
        """Every entry of each hash (None for an unparsable value), in order."""

    def _live(self, worker_ids: Collection[str]) -> Mapping[str, str]:
        """Live incarnation of each of ``worker_ids``; absent = dead."""
        try:
            return self._liveness.live_incarnations(worker_ids)
        except RegistryUnavailable as e:
            raise IndexUnavailable(f"liveness: {e}") from e

    @abstractmethod
    def _forget(self, stale: list[tuple[BlockHash, str, Entry | None]]) -> int:
        """Delete entries still equal to the stale value read; return how many went."""


class RedisPrefixIndex(PrefixIndex):
    """The shared index in Redis; liveness comes from the ``WorkerRegistry`` of the same model.

    Use a client from ``worker_registry.connect`` (short timeouts, no retries): a lookup then
    fails within about one socket timeout per round trip instead of stalling a request.
    """

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        *,
        entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
        events_maxlen: int | None = None,
        block_size: int | None = None,
        first_chunk: int = DEFAULT_FIRST_CHUNK,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> None:
        """``events_maxlen`` enables the ``events`` stream (approximately that long).
        ``block_size`` only fills the field of the same name in stream events.

        NOTE: liveness is read through a registry on this same ``client``, so a lookup's
        liveness round trip has the lookup's (short) timeout, not the registry client's.
        """
        liveness = WorkerRegistry(client, model)
        super().__init__(liveness, first_chunk=first_chunk, max_chunk=max_chunk)
        if entry_ttl_s <= 0:
            raise ValueError(f"entry_ttl_s: must be positive, got {entry_ttl_s}")
        if events_maxlen is not None and events_maxlen <= 0:
            raise ValueError(f"events_maxlen: must be positive, got {events_maxlen}")
        self._client = client
        self._prefix = key_prefix(model)
        self._ttl_ms = max(1, int(entry_ttl_s * 1000))
        self._events_maxlen = events_maxlen
        self._block_size = block_size
        self._cleanup = client.register_script(_CLEANUP_LUA)

    def block_key(self, block_hash: BlockHash) -> str:
        """The Redis key of one block hash: ``ps:{model}:blk:{hash_hex}``."""
        return f"{self._prefix}blk:{block_hash.hex()}"

    @property
    def events_key(self) -> str:
        return f"{self._prefix}events"

    def clear(self, worker_id: str, block_hashes: Iterable[BlockHash] = ()) -> None:
        check_worker_id(worker_id)
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.hdel(self.block_key(_checked(h)), worker_id)
            if self._events_maxlen is not None:
                self._xadd(pipe, worker_id, "", [{"type": ALL_CLEARED}])
            pipe.execute()
        except _REDIS_ERRORS as e:
            raise IndexUnavailable(f"clear {worker_id}: {e}") from e

    def read_events(self, after: str = "0-0", count: int = 1000) -> list[KvEventBatch]:
        """Stream entries after id ``after``, oldest first (for a router replaying the index)."""
        try:
            rows = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                self._client.xrange(self.events_key, min=f"({after}", count=count),
            )
        except _REDIS_ERRORS as e:
            raise IndexUnavailable(f"read_events: {e}") from e
        return [_parse_batch(stream_id, fields) for stream_id, fields in rows]

    def _apply(
        self, worker_id: str, incarnation: str, events: list[BlockEvent], *, record: bool = True
    ) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            for event in events:
                key = self.block_key(_checked(event.block_hash))
                if event.kind is BlockEventKind.STORED:
                    pipe.hset(key, worker_id, Entry(event.tier, incarnation).encode())
                    pipe.pexpire(key, self._ttl_ms)
                else:
                    # NOTE: Redis deletes a hash when its last field goes, so no empty keys stay.
                    pipe.hdel(key, worker_id)
            if record and self._events_maxlen is not None:
                batch = _vllm_events(events, self._block_size)
                self._xadd(pipe, worker_id, incarnation, batch)
            pipe.execute()
        except _REDIS_ERRORS as e:
            raise IndexUnavailable(f"publish {worker_id}: {e}") from e

    def _xadd(
        self,
        pipe: redis.client.Pipeline,
        worker_id: str,
        incarnation: str,
        events: list[dict[str, object]],
    ) -> None:
        fields: dict[FieldT, EncodableT] = {
            "ts": repr(time.time()),
            "worker_id": worker_id,
            "incarnation": incarnation,
            "events": json.dumps(events, separators=(",", ":")),
        }
        pipe.xadd(self.events_key, fields, maxlen=self._events_maxlen, approximate=True)

    def _fetch(self, block_hashes: Sequence[BlockHash]) -> list[dict[str, Entry | None]]:
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.hgetall(self.block_key(_checked(h)))
            rows = pipe.execute()
        except _REDIS_ERRORS as e:
            raise IndexUnavailable(f"lookup: {e}") from e
        return [{w.decode(): Entry.decode(v) for w, v in row.items()} for row in rows]

    def _forget(self, stale: list[tuple[BlockHash, str, Entry | None]]) -> int:
        keys = [self.block_key(h) for h, _, _ in stale]
        args: list[str] = []
        for _, worker_id, entry in stale:
            args += [worker_id, entry.encode() if entry is not None else ""]
        try:
            # NOTE: a malformed value (entry None) is read back as "" and so never matched;
            # it stays until its key's TTL.
            return int(self._cleanup(keys=keys, args=args))
        except _REDIS_ERRORS as e:
            raise IndexUnavailable(f"cleanup: {e}") from e


class LocalPrefixIndex(PrefixIndex):
    """The same index in this process's memory (no Redis): a dict with per-key expiry.

    ``liveness`` None: the incarnation that published last for a worker is its live one (one
    process, nothing else to die; a restarted worker's first publish retires the entries of its
    previous incarnation). Give a ``StaticLiveness`` or a ``WorkerRegistry`` to get the
    incarnation rules of ``RedisPrefixIndex``.
    ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(
        self,
        *,
        liveness: Liveness | None = None,
        entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        first_chunk: int = DEFAULT_FIRST_CHUNK,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> None:
        self._published = StaticLiveness()  # worker_id -> incarnation of its last publish
        super().__init__(liveness or self._published, first_chunk=first_chunk, max_chunk=max_chunk)
        if entry_ttl_s <= 0:
            raise ValueError(f"entry_ttl_s: must be positive, got {entry_ttl_s}")
        self._ttl_s = entry_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # block hash -> (expires_at, worker_id -> entry)
        self._blocks: dict[BlockHash, tuple[float, dict[str, Entry]]] = {}

    def __len__(self) -> int:
        """Number of unexpired keys (for tests)."""
        now = self._clock()
        with self._lock:
            return sum(1 for expires_at, _ in self._blocks.values() if expires_at > now)

    def clear(self, worker_id: str, block_hashes: Iterable[BlockHash] = ()) -> None:
        check_worker_id(worker_id)
        with self._lock:
            for h in block_hashes:
                self._remove(_checked(h), worker_id)

    def _apply(
        self, worker_id: str, incarnation: str, events: list[BlockEvent], *, record: bool = True
    ) -> None:
        expires_at = self._clock() + self._ttl_s
        with self._lock:
            self._published.set_alive(worker_id, incarnation)
            for event in events:
                h = _checked(event.block_hash)
                if event.kind is BlockEventKind.STORED:
                    _, entries = self._live_key(h) or (0.0, {})
                    entries[worker_id] = Entry(event.tier, incarnation)
                    self._blocks[h] = (expires_at, entries)
                else:
                    self._remove(h, worker_id)

    def _fetch(self, block_hashes: Sequence[BlockHash]) -> list[dict[str, Entry | None]]:
        rows: list[dict[str, Entry | None]] = []
        with self._lock:
            for h in block_hashes:
                found = self._live_key(_checked(h))
                rows.append({w: e for w, e in found[1].items()} if found is not None else {})
        return rows

    def _forget(self, stale: list[tuple[BlockHash, str, Entry | None]]) -> int:
        n = 0
        with self._lock:
            for h, worker_id, entry in stale:
                found = self._live_key(h)
                if found is not None and found[1].get(worker_id) == entry:
                    self._remove(h, worker_id)
                    n += 1
        return n

    def _live_key(self, h: BlockHash) -> tuple[float, dict[str, Entry]] | None:
        found = self._blocks.get(h)
        if found is not None and found[0] <= self._clock():
            del self._blocks[h]
            return None
        return found

    def _remove(self, h: BlockHash, worker_id: str) -> None:
        found = self._live_key(h)
        if found is None:
            return
        found[1].pop(worker_id, None)
        if not found[1]:
            del self._blocks[h]


def _check_incarnation(incarnation: str) -> None:
    if not incarnation or ":" in incarnation:
        raise ValueError(f"incarnation: must be non-empty without ':', got {incarnation!r}")


def _checked(block_hash: BlockHash) -> BlockHash:
    if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"block_hash: expected {BLOCK_HASH_BYTES} bytes, got {block_hash!r}")
    return block_hash


def _vllm_events(events: list[BlockEvent], block_size: int | None) -> list[dict[str, object]]:
    """Group consecutive events of one kind and tier into vLLM-shaped BlockStored /
    BlockRemoved dicts (``medium``: the tier, ``dev``, ``host`` or ``disk``)."""
    out: list[dict[str, object]] = []
    hashes: list[str] = []
    for event in events:
        kind = STORED if event.kind is BlockEventKind.STORED else REMOVED
        if not out or out[-1]["type"] != kind or out[-1]["medium"] != event.tier.value:
            hashes = []
            out.append(_vllm_event(kind, hashes, event.tier, block_size))
        hashes.append(event.block_hash.hex())
    return out


def _vllm_event(
    kind: str, hashes: list[str], tier: Tier, block_size: int | None
) -> dict[str, object]:
    if kind == REMOVED:
        return {"type": kind, "block_hashes": hashes, "medium": tier.value}
    # NOTE: BlockPool events carry no parent or tokens; those vLLM fields stay empty.
    return {
        "type": kind,
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": tier.value,
    }


def _parse_batch(stream_id: bytes, fields: Mapping[bytes, bytes]) -> KvEventBatch:
    return KvEventBatch(
        stream_id=stream_id.decode(),
        ts=float(fields[b"ts"]),
        worker_id=fields[b"worker_id"].decode(),
        incarnation=fields[b"incarnation"].decode(),
        events=json.loads(fields[b"events"]),
    )
