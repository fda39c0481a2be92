"""BlockPool: owns every KV block id, its reference count, its hash and the cached blocks.

A block is in exactly one state::

    FREE    ref == 0, no hash     on the free list (FIFO), allocatable
    USED    ref  > 0              held by one or more block tables; may carry a hash
    CACHED  ref == 0, has a hash  in the evictor, reusable by a prefix hit, evictable

    allocate ──► USED ──free (ref 0)──► FREE     (no hash)
                  ▲  └──free (ref 0)──► CACHED   (hash) ──evict / reset──► FREE
                  └──────── acquire ─────┘

Which CACHED block is evicted first is the evictor's call (``eviction.py``: ``lru``, or
``hits``: decayed prefix hits, then depth in the chain). The pool knows nothing about tensors;
the KV pages are indexed by the same block ids elsewhere.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NewType, Protocol

from pagedserve.kvstore.eviction import (
    EvictionPolicy,
    Evictor,
    make_evictor,
    parse_eviction_policy,
)
from pagedserve.kvstore.hashing import BLOCK_HASH_BYTES, BlockHash

BlockId = NewType("BlockId", int)


class BlockEventKind(enum.Enum):
    """What happened to a block hash in this pool (the prefix index mirrors these)."""

    STORED = "stored"
    REMOVED = "removed"


class Tier(enum.Enum):
    """Where a worker holds a block: its device KV pool, its host-memory tier or its disk tier
    (the prefix index's ``{tier}:{incarnation}`` values, docs/prefix_index.md)."""

    DEV = "dev"
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A hash became reachable (STORED) in ``tier`` of this worker, or unreachable in every
    tier (REMOVED; ``tier`` then names the tier it left). A STORED of a hash already held in
    another tier moves it (one worker holds a hash in one tier at a time)."""

    kind: BlockEventKind
    block_hash: BlockHash
    tier: Tier = Tier.DEV


EventSink = Callable[[BlockEventKind, BlockHash, Tier], None]


class TierListener(Protocol):
    """A lower tier of the prefix cache (``kv_offload.KVOffload``): told of every CACHED block
    ``allocate`` evicts, while its KV is still intact, and of every hash newly stored here.

    ``attach`` gives it the pool's event log (``set_tier`` calls it), so that its own moves
    reach the prefix index in order with the pool's. ``evicted`` returns whether the tier kept
    the block: then it recorded the move itself (STORED in its tier) and the pool records no
    REMOVED."""

    def attach(self, sink: EventSink) -> None: ...
    def evicted(self, block_id: BlockId, block_hash: BlockHash, depth: int) -> bool: ...
    def stored(self, block_hash: BlockHash) -> None: ...
    def reset(self) -> None: ...


class BlockPool:
    """Reference-counted KV blocks ``0 .. num_blocks-1`` with a hash → block map for prefix reuse.

    Contracts:
    - Every ``allocate``/``acquire`` is matched by exactly one ``free`` per block id; the pool
      raises RuntimeError on a double free instead of corrupting its lists.
    - A block id returned by ``allocate`` or ``lookup`` is safe to use only while the caller holds
      a reference: ``lookup`` alone takes none, so ``acquire`` before the next ``allocate``.
    - Events are kept until ``drain_events`` is called; the owner must drain them regularly (or
      construct the pool with ``record_events=False``), since nothing else bounds the list.
    - ``eviction_policy`` changes only which CACHED block ``allocate`` takes first; states,
      counts and events are the same under every policy.
    """

    __slots__ = (
        "_block_size",
        "_cached",
        "_depths",
        "_eviction_policy",
        "_events",
        "_free",
        "_hash_to_block",
        "_hashes",
        "_listener",
        "_num_blocks",
        "_num_used",
        "_record_events",
        "_refs",
        "__weakref__",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        record_events: bool = True,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._depths = [0] * num_blocks
        self._listener: TierListener | None = None
        self._free: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))
        self._eviction_policy = parse_eviction_policy(eviction_policy)
        self._cached: Evictor = make_evictor(self._eviction_policy, num_blocks)
        self._hash_to_block: dict[BlockHash, BlockId] = {}
        self._num_used = 0
        self._record_events = record_events
        self._events: list[BlockEvent] = []

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self._eviction_policy

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_refs(self) -> int:
        """References held on all blocks together (a block shared by two tables counts 2)."""
        return sum(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_allocatable(self) -> int:
        """Blocks ``allocate`` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by tables (cached blocks count as not used)."""
        return self._num_used / self._num_blocks

    def set_tier(self, listener: TierListener | None) -> None:
        """Attach (or detach, None) the lower tier that receives evicted cached blocks; it
        records its own events into this pool's (``drain_events``)."""
        self._listener = listener
        if listener is not None:
            listener.attach(self._record)

    # -- allocation ----------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now. Changes nothing."""
        _check_count(num_blocks)
        return num_blocks <= self.num_allocatable

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Take ``num_blocks`` blocks with ref 1, or return None (changing nothing) if short.

        Free blocks go first, oldest-freed first; then cached blocks are evicted in the
        evictor's order (``lru``: least recently used first), losing their hash (a REMOVED event
        each; with a tier attached, ``set_tier``, the tier copies each one's KV out first, and
        a block it keeps is recorded by the tier as STORED in its tier instead). The
        caller owns one reference to each returned block and must ``free`` it.
        """
        if not self.can_allocate(num_blocks):
            return None
        taken: list[BlockId] = []
        while len(taken) < num_blocks and self._free:
            taken.append(self._free.popleft())
        while len(taken) < num_blocks:
            block_id = self._cached.pop()
            block_hash = self._hashes[block_id]
            kept = False
            if self._listener is not None and block_hash is not None:
                kept = self._listener.evicted(block_id, block_hash, self._depths[block_id])
            # NOTE: a block the tier kept was recorded there as STORED in its tier: a REMOVED
            # after it would delete the worker's index entry.
            self._drop_hash(block_id, record=not kept)
            taken.append(block_id)
        for block_id in taken:
            self._refs[block_id] = 1
        self._num_used += len(taken)
        self._cached.advance(len(taken))
        return taken

    def acquire(self, block_ids: Iterable[BlockId], *, hit: bool = True) -> None:
        """Take one more reference to each block (a prefix hit or a fork).

        A CACHED block leaves the evictor and becomes USED. Each id that carries a hash counts
        as one prefix hit for the ``hits`` eviction policy (the reference ``allocate`` hands out
        is not a hit; nor is one taken with ``hit=False``, a pin while promoting from the host
        tier). Acquiring a FREE block raises RuntimeError, checked for every id before
        anything changes.
        """
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
            if self._refs[block_id] == 0 and self._hashes[block_id] is None:
                raise RuntimeError(f"acquire: block {block_id} is FREE; only used or cached blocks")
        for block_id in ids:
            if hit and self._hashes[block_id] is not None:
                self._cached.hit(block_id)
            if self._refs[block_id] == 0:
                self._cached.remove(block_id)
                self._num_used += 1
            self._refs[block_id] += 1

    def free(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference to each block, in the given order.

        A block reaching ref 0 becomes CACHED (the most recently used of the evictor) if it has
        a hash, else FREE (tail of the free list). So free a sequence's blocks tail first if its
        head should outlive its tail in the cache. Dropping more references than a block holds
        raises RuntimeError (double free), checked for every id before anything changes.
        """
        ids = list(block_ids)
        drops: dict[BlockId, int] = {}
        for block_id in ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
            if drops[block_id] > self._refs[block_id]:
                raise RuntimeError(
                    f"free: block {block_id} has ref {self._refs[block_id]} (double free)"
                )
        for block_id in ids:
            self._refs[block_id] -= 1
            if self._refs[block_id] > 0:
                continue
            self._num_used -= 1
            if self._hashes[block_id] is None:
                self._free.append(block_id)
            else:
                self._cached.push(block_id)

    # -- prefix cache --------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> BlockId | None:
        """The block registered under ``block_hash``, or None. Takes no reference."""
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: BlockId, block_hash: BlockHash, depth: int = 0) -> BlockId:
        """Register the USED, fully computed ``block_id`` under ``block_hash``; return the owner.

        Returns ``block_id`` when it is (now) the block for this hash (a STORED event if newly
        mapped). If another block already holds ``block_hash``, that mapping wins: its id is
        returned and ``block_id`` stays unregistered (the caller keeps using its own block).
        RuntimeError if ``block_id`` is not USED or already carries a different hash.

        ``depth`` is the block's index in its sequence (0: the first block of the hash chain);
        the ``hits`` eviction policy evicts deeper blocks first among equals. 0 when unknown.
        """
        self._check_id(block_id)
        if depth < 0:
            raise ValueError(f"depth: must be >= 0, got {depth}")
        if len(block_hash) != BLOCK_HASH_BYTES:
            raise ValueError(f"block_hash: expected {BLOCK_HASH_BYTES} bytes, got {block_hash!r}")
        if self._refs[block_id] == 0:
            raise RuntimeError(f"cache_block: block {block_id} is not used (ref 0)")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise RuntimeError(
                    f"cache_block: block {block_id} already has hash {current.hex()}, "
                    f"not {block_hash.hex()}"
                )
            return block_id
        owner = self._hash_to_block.get(block_hash)
        if owner is not None:
            return owner
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        self._depths[block_id] = depth
        self._cached.hashed(block_id, depth)
        self._record(BlockEventKind.STORED, block_hash)
        if self._listener is not None:
            self._listener.stored(block_hash)
        return block_id

    def reset_prefix_cache(self) -> int:
        """Move every CACHED block to FREE (REMOVED events); return how many moved.

        USED blocks keep their hashes and become CACHED when freed, as usual. Blocks move in
        eviction order. An attached tier is emptied too (nothing is offloaded).
        """
        if self._listener is not None:
            self._listener.reset()
        moved = 0
        while len(self._cached):
            block_id = self._cached.pop()
            self._drop_hash(block_id)
            self._free.append(block_id)
            moved += 1
        return moved

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        self._check_id(block_id)
        return self._hashes[block_id]

    def ref_count(self, block_id: BlockId) -> int:
        self._check_id(block_id)
        return self._refs[block_id]

    def registered_hashes(self) -> list[BlockHash]:
        """Every hash the pool can serve a prefix hit for now (USED or CACHED blocks)."""
        return list(self._hash_to_block)

    # -- events --------------------------------------------------------------------------------

    def drain_events(self) -> list[BlockEvent]:
        """Return the events recorded since the last drain, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    # -- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first broken invariant of the pool's bookkeeping."""
        free_set = set(self._free)
        cached_set = set(self._cached)
        if len(free_set) != len(self._free):
            raise RuntimeError("integrity: free list has duplicate block ids")
        used = [b for b in range(self._num_blocks) if self._refs[b] > 0]
        if any(r < 0 for r in self._refs):
            raise RuntimeError("integrity: negative reference count")
        if len(used) != self._num_used:
            raise RuntimeError(
                f"integrity: {len(used)} blocks have ref > 0, counter {self._num_used}"
            )
        num_cached = len(self._cached)
        if len(self._free) + len(used) + num_cached != self._num_blocks:
            raise RuntimeError(
                f"integrity: free {len(self._free)} + used {len(used)} + cached {num_cached} "
                f"!= total {self._num_blocks}"
            )
        for block_id in range(self._num_blocks):
            self._check_block_state(BlockId(block_id), block_id in free_set, block_id in cached_set)
        for block_hash, block_id in self._hash_to_block.items():
            if self._hashes[block_id] != block_hash:
                raise RuntimeError(f"integrity: map sends {block_hash.hex()} to block {block_id}")
        self._cached.check_integrity()

    def _check_block_state(self, block_id: BlockId, in_free: bool, in_cached: bool) -> None:
        ref = self._refs[block_id]
        block_hash = self._hashes[block_id]
        if in_free + in_cached + (ref > 0) != 1:
            raise RuntimeError(
                f"integrity: block {block_id} (ref {ref}, free list {in_free}, cached {in_cached}) "
                "is not in exactly one state"
            )
        if in_free and block_hash is not None:
            raise RuntimeError(f"integrity: FREE block {block_id} has a hash")
        if in_cached and block_hash is None:
            raise RuntimeError(f"integrity: CACHED block {block_id} has no hash")
        if block_hash is not None and self._hash_to_block.get(block_hash) != block_id:
            raise RuntimeError(f"integrity: block {block_id}'s hash does not map back to it")

    # -- internals -----------------------------------------------------------------------------

    def _drop_hash(self, block_id: BlockId, *, record: bool = True) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is None:
            raise RuntimeError(f"block {block_id} is cached without a hash")
        self._hashes[block_id] = None
        self._depths[block_id] = 0
        del self._hash_to_block[block_hash]
        self._cached.unhashed(block_id)
        if record:
            self._record(BlockEventKind.REMOVED, block_hash)

    def _record(self, kind: BlockEventKind, block_hash: BlockHash, tier: Tier = Tier.DEV) -> None:
        if self._record_events:
            self._events.append(BlockEvent(kind, block_hash, tier))

    def _check_id(self, block_id: BlockId) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block_id: must be in [0, {self._num_blocks}), got {block_id!r}")


def _check_count(num_blocks: int) -> None:
    if num_blocks < 0:
        raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
