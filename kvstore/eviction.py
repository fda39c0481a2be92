"""Evictors: the order in which a ``BlockPool`` gives up its CACHED blocks (``--eviction-policy``).

A CACHED block (ref 0, hash kept) is a prefix some later request may hit; ``allocate`` takes
one only when the free list is empty, and the evictor names which. Two policies:

``lru``   least recently released first (an OrderedDict: insertion order is recency).
``hits``  the block least likely to be hit again first: prefix hits (decayed) buy time in the
          cache, and among equals the deepest block of a chain goes first::

              key(block) = ( t_release + H * log2(1 + hits_decayed(t_release)),   smallest first
                             -depth,                                              leaf before root
                             release order )                                      then LRU

          ``t`` is the pool's clock: blocks handed out by ``allocate`` so far (cache churn, not
          seconds: deterministic, and the same speed on any hardware). ``H`` is the half-life of
          a hit, one pool's worth of blocks by default. ``hits_decayed`` is LRFU's combined
          count: every prefix hit (an ``acquire`` of a hashed block) adds 1, and the sum halves
          every ``H`` ticks.

NOTE: the first term is LRFU's (Lee et al., 2001) combined recency-frequency, ``1 + hits``
decaying by half every ``H`` ticks, written as the tick at which it has decayed to 1: comparing
these ticks compares the two blocks' decayed values at any common moment, so a key computed at
release never needs updating while the block stays CACHED (a hit takes it out of the cache).
A block hit ``n`` times lives about ``H * log2(1 + n)`` ticks longer than a block of one-off
prompt released with it. With no hits at all the order is LRU's, except that blocks released
with no allocation in between go deepest first (a chain released in one call goes leaf first, as
``BlockTable.free`` already releases it).

NOTE: depth only breaks ties because hits already order a chain: a prefix match
(``KVCacheManager.match_prefix``) acquires every block before the one it needs, so a root is hit
at least as often as its leaves and released no earlier than them. Ties are the common case
inside a chain (same hits, same release), and there a root must outlive its leaves: a leaf
without its root can never be matched.

Both evictors are O(log n) or better per operation: ``hits`` is a heap with lazy deletion (a
revived block's stale entry stays in the heap until popped or compacted away).
"""

from __future__ import annotations

import argparse
import enum
import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedserve.kvstore.block_pool import BlockId

_COMPACT_MIN = 64  # NOTE: below this many stale heap entries, compacting costs more than it saves


class EvictionPolicy(enum.Enum):
    """Which CACHED block ``BlockPool.allocate`` evicts first (``--eviction-policy``)."""

    LRU = "lru"
    HITS = "hits"


DEFAULT_EVICTION_POLICY = EvictionPolicy.HITS
"""The workers' default (docs/kv_layout.md, "Eviction"); ``BlockPool`` alone
defaults to LRU, so a pool built without a policy behaves as it always has."""


def add_eviction_argument(parser: argparse.ArgumentParser) -> None:
    """`--eviction-policy`, the same flag on `pagedserve prefill` and `pagedserve decode`."""
    parser.add_argument(
        "--eviction-policy", default=DEFAULT_EVICTION_POLICY.value,
        choices=[p.value for p in EvictionPolicy],
        help="which cached prefix block is evicted first when the KV pool runs short: hits "
        "(fewest decayed prefix hits, leaves before roots) or lru (docs/kv_layout.md)",
    )  # fmt: skip


def parse_eviction_policy(value: EvictionPolicy | str) -> EvictionPolicy:
    """``value`` as an ``EvictionPolicy``; ValueError naming the choices for an unknown name."""
    try:
        return EvictionPolicy(value)
    except ValueError:
        names = ", ".join(p.value for p in EvictionPolicy)
        raise ValueError(f"eviction_policy: unknown {value!r} (choose from {names})") from None


class Evictor(Protocol):
    """The CACHED blocks of one pool, in eviction order. The pool calls it; nothing else does.

    Contracts: ``push`` a block when it becomes CACHED, ``remove`` it when a hit revives it,
    ``pop`` the victim when ``allocate`` runs short of free blocks. ``hashed``/``unhashed``
    bracket the life of one block's contents (its hash); ``hit`` is called on every prefix hit
    of a hashed block, USED or CACHED, before any ``remove``; ``advance`` ticks the clock by the
    number of blocks allocated.
    """

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[BlockId]: ...
    def push(self, block_id: BlockId) -> None: ...
    def remove(self, block_id: BlockId) -> None: ...
    def pop(self) -> BlockId: ...
    def hashed(self, block_id: BlockId, depth: int) -> None: ...
    def unhashed(self, block_id: BlockId) -> None: ...
    def hit(self, block_id: BlockId) -> None: ...
    def advance(self, num_blocks: int) -> None: ...
    def check_integrity(self) -> None: ...


def make_evictor(policy: EvictionPolicy | str, num_blocks: int) -> Evictor:
    """The evictor of ``policy`` for a pool of ``num_blocks`` blocks."""
    if parse_eviction_policy(policy) is EvictionPolicy.LRU:
        return LruEvictor()
    return HitsEvictor(num_blocks)


class LruEvictor:
    """Least recently released first: the pool's behaviour before evictors existed."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        # NOTE: insertion order is recency: first = least recently used = evicted first.
        self._order: OrderedDict[BlockId, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[BlockId]:
        return iter(self._order)

    def push(self, block_id: BlockId) -> None:
        self._order[block_id] = None

    def remove(self, block_id: BlockId) -> None:
        del self._order[block_id]

    def pop(self) -> BlockId:
        return self._order.popitem(last=False)[0]

    def hashed(self, block_id: BlockId, depth: int) -> None:
        pass

    def unhashed(self, block_id: BlockId) -> None:
        pass

    def hit(self, block_id: BlockId) -> None:
        pass

    def advance(self, num_blocks: int) -> None:
        pass

    def check_integrity(self) -> None:
        pass


class HitsEvictor:
    """Fewest decayed prefix hits first, leaves before roots, then LRU (see the module doc).

    ``half_life`` is in blocks allocated; default: the pool's size.
    """

    __slots__ = ("_clock", "_depth", "_heap", "_hit_clock", "_hits", "_live", "_seq", "half_life")

    def __init__(self, num_blocks: int, *, half_life: float | None = None) -> None:
        if half_life is not None and half_life <= 0:
            raise ValueError(f"half_life: must be > 0, got {half_life}")
        self.half_life = float(half_life or num_blocks)
        self._clock = 0
        self._seq = 0
        self._hits = [0.0] * num_blocks  # decayed to _hit_clock[block]
        self._hit_clock = [0] * num_blocks
        self._depth = [0] * num_blocks
        # NOTE: a heap entry is live iff _live[block] is its seq; others are stale (lazy delete).
        self._heap: list[tuple[float, int, int, BlockId]] = []
        self._live: dict[BlockId, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[BlockId]:
        return iter(self._live)

    def key(self, block_id: BlockId) -> float:
        """The first term of the block's key were it released now (ticks; larger lives longer)."""
        return self._clock + self.half_life * math.log2(1.0 + self._decayed(block_id))

    def push(self, block_id: BlockId) -> None:
        self._seq += 1
        self._live[block_id] = self._seq
        heapq.heappush(
            self._heap, (self.key(block_id), -self._depth[block_id], self._seq, block_id)
        )

    def remove(self, block_id: BlockId) -> None:
        del self._live[block_id]
        if len(self._heap) > 2 * len(self._live) + _COMPACT_MIN:
            self._heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def pop(self) -> BlockId:
        while True:
            _, _, seq, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == seq:
                del self._live[block_id]
                return block_id

    def hashed(self, block_id: BlockId, depth: int) -> None:
        self._depth[block_id] = depth
        self._hits[block_id] = 0.0
        self._hit_clock[block_id] = self._clock

    def unhashed(self, block_id: BlockId) -> None:
        self._depth[block_id] = 0
        self._hits[block_id] = 0.0

    def hit(self, block_id: BlockId) -> None:
        self._hits[block_id] = self._decayed(block_id) + 1.0
        self._hit_clock[block_id] = self._clock

    def advance(self, num_blocks: int) -> None:
        self._clock += num_blocks

    def check_integrity(self) -> None:
        live = sum(1 for e in self._heap if self._live.get(e[3]) == e[2])
        if live != len(self._live):
            raise RuntimeError(
                f"integrity: evictor heap has {live} live entries for {len(self._live)} blocks"
            )

    def _decayed(self, block_id: BlockId) -> float:
        elapsed = self._clock - self._hit_clock[block_id]
        return self._hits[block_id] * 2.0 ** (-elapsed / self.half_life)
