"""HostTier: the bookkeeping of the prefix cache's host-memory tier (``--kv-offload-memory``).

When the device ``BlockPool`` evicts a CACHED block (ref 0, with a hash) to reuse it, the
block's KV is first copied into a host slot, indexed by the same chained ``BlockHash``. A later
prefix match that runs past the device's blocks into hashes held here promotes them back (one
host → device copy each, no recompute). Torch-free: ``kv_offload.py`` owns the tensors and the
copies; this module only says which slot holds which hash.

A slot is in exactly one state::

    FREE    no hash    on the free list (FIFO)
    CACHED  a hash     in the tier's evictor, found by ``lookup``
    PINNED  a hash     being promoted: found by ``lookup``, never evicted

    store ──► CACHED ──evicted by a later store / discard──► FREE
                 └──pin──► PINNED ──take (promoted)──► FREE
                              └──unpin──► CACHED

``free + cached + pinned == total`` always; a promotion pins the slots it wants before it
allocates device blocks (which may evict more blocks into the tier), so those stores cannot
reuse them. With every slot pinned a store is skipped (the evicted block is dropped). The tier is
exclusive of the device pool: a hash is in at most one of the two (a promotion takes it out of
the tier, and a device block registered under a hash the tier holds drops the tier's copy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType

from pagedserve.kvstore.eviction import EvictionPolicy, Evictor, make_evictor
from pagedserve.kvstore.hashing import BlockHash

SlotId = NewType("SlotId", int)


@dataclass(slots=True)
class TierStats:
    """Monotonic counters of one tier, in blocks (bytes: blocks x bytes per block)."""

    writes: int = 0  # blocks copied device → host (an evicted device block offloaded)
    hits: int = 0  # prefix-match lookups answered by the tier (before any promotion limit)
    promotions: int = 0  # blocks copied host → device and registered on the device again
    evictions: int = 0  # slots reused for a newer block, their hash dropped
    dropped: int = 0  # evicted device blocks not stored (every slot pinned)
    discards: int = 0  # slots dropped because the device registered the same hash again


@dataclass(frozen=True, slots=True)
class OffloadCounts:
    """The offload tiers' metrics (``pagedserve:kv_offload_*``; docs/metrics.md): counters in
    blocks and bytes, and levels (``blocks_cached``, ``blocks_total``). The ``disk_*`` fields
    are None (no series) without the disk tier (``--kv-offload-dir``)."""

    writes: int
    write_bytes: int
    hits: int
    promotions: int
    promotion_bytes: int
    evictions: int
    blocks_cached: int
    blocks_total: int
    disk_writes: int | None = None
    disk_write_bytes: int | None = None
    disk_hits: int | None = None
    disk_promotions: int | None = None
    disk_promotion_bytes: int | None = None
    disk_evictions: int | None = None
    disk_dropped: int | None = None
    disk_corrupt_files: int | None = None
    disk_blocks_cached: int | None = None
    disk_bytes_used: int | None = None
    disk_capacity_bytes: int | None = None


OFFLOAD_GAUGES = (
    "blocks_cached", "blocks_total", "disk_blocks_cached", "disk_bytes_used", "disk_capacity_bytes",
)  # fmt: skip


class HostTier:
    """``num_slots`` host slots keyed by ``BlockHash`` with their own evictor.

    Contracts:
    - ``store`` always succeeds for a new hash (evicting the evictor's choice when full) and
      returns None for a hash already held (nothing to copy).
    - ``take`` (promotion) and ``discard`` free a slot; nothing else does, except a ``store``
      that evicts.
    - ``eviction_policy`` changes only which slot a full tier reuses (``hits``: with no hits
      in the host tier, least recently stored first, deepest first among blocks stored together).
    """

    __slots__ = (
        "_cached",
        "_free",
        "_hash_to_slot",
        "_hashes",
        "_num_slots",
        "_pinned",
        "on_evict",
        "policy",
        "stats",
    )

    def __init__(
        self, num_slots: int, *, eviction_policy: EvictionPolicy | str = EvictionPolicy.HITS
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots: must be positive, got {num_slots}")
        self._num_slots = num_slots
        self._free: deque[SlotId] = deque(SlotId(i) for i in range(num_slots))
        self._hashes: list[BlockHash | None] = [None] * num_slots
        self._hash_to_slot: dict[BlockHash, SlotId] = {}
        self.policy = EvictionPolicy(eviction_policy)
        # NOTE: the evictors are written for BlockIds; a slot id is an int in the same range.
        self._cached: Evictor = make_evictor(self.policy, num_slots)
        self._pinned: set[SlotId] = set()
        self.stats = TierStats()
        # NOTE: the disk tier (kv_offload.KVOffload) spills a slot here before a store reuses
        # it, while the slot still holds the evicted block's KV.
        self.on_evict: Callable[[SlotId, BlockHash], object] | None = None

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Slots holding a block (pinned ones included)."""
        return len(self._cached) + len(self._pinned)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hash_to_slot

    def lookup(self, block_hash: BlockHash) -> SlotId | None:
        """The slot holding ``block_hash``, or None. Changes nothing."""
        return self._hash_to_slot.get(block_hash)

    def slot_of(self, block_hash: BlockHash) -> SlotId:
        """The slot holding ``block_hash``; KeyError naming it if the tier does not hold it."""
        slot = self._hash_to_slot.get(block_hash)
        if slot is None:
            raise KeyError(f"host tier holds no block {block_hash.hex()}")
        return slot

    def store(self, block_hash: BlockHash, depth: int = 0) -> SlotId | None:
        """A slot now registered under ``block_hash`` for the caller to fill, or None when the
        tier already holds that hash or every slot is pinned. Takes a free slot, else evicts
        one (its hash dropped)."""
        if block_hash in self._hash_to_slot:
            return None
        if self._free:
            slot = self._free.popleft()
        elif not len(self._cached):
            self.stats.dropped += 1
            return None
        else:
            slot = SlotId(self._cached.pop())
            if self.on_evict is not None:
                self.on_evict(slot, self._hashes[slot])  # type: ignore[arg-type]
            self._drop(slot)
            self.stats.evictions += 1
        self._hashes[slot] = block_hash
        self._hash_to_slot[block_hash] = slot
        self._cached.hashed(slot, depth)  # type: ignore[arg-type]
        self._cached.push(slot)  # type: ignore[arg-type]
        self._cached.advance(1)
        self.stats.writes += 1
        return slot

    def pin(self, block_hash: BlockHash) -> SlotId:
        """Keep the CACHED slot of ``block_hash`` from eviction until ``take`` or ``unpin``."""
        slot = self.slot_of(block_hash)
        if slot in self._pinned:
            raise RuntimeError(f"pin: host slot {slot} is already pinned")
        self._cached.remove(slot)  # type: ignore[arg-type]
        self._pinned.add(slot)
        return slot

    def unpin(self, block_hash: BlockHash) -> None:
        """A pinned slot not promoted after all: CACHED again (the most recent)."""
        slot = self.slot_of(block_hash)
        self._pinned.remove(slot)
        self._cached.push(slot)  # type: ignore[arg-type]

    def take(self, block_hash: BlockHash) -> SlotId:
        """Free the pinned slot of ``block_hash`` (its KV was promoted); KeyError if not held or
        not pinned. The caller must have finished reading the slot (the copy is complete, or
        runs in stream order before any later store's copy into it)."""
        slot = self.slot_of(block_hash)
        self._pinned.remove(slot)
        self._drop(slot)
        self._free.append(slot)
        self.stats.promotions += 1
        return slot

    def discard(self, block_hash: BlockHash) -> bool:
        """Drop ``block_hash`` if held and not pinned (the device holds it again); whether it
        was dropped."""
        slot = self._hash_to_slot.get(block_hash)
        if slot is None or slot in self._pinned:
            return False
        self._release(slot)
        self.stats.discards += 1
        return True

    def clear(self) -> int:
        """Free every slot (the prefix cache was reset); how many were freed."""
        if self._pinned:
            raise RuntimeError("clear: host slots are pinned by a promotion in progress")
        held = list(self._hash_to_slot.values())
        for slot in held:
            self._release(slot)
        return len(held)

    def hashes(self) -> list[BlockHash]:
        return list(self._hash_to_slot)

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the first broken invariant (``free + cached + pinned ==
        total``, every slot in one state, the hash map a bijection onto the held slots)."""
        free_set, cached_set, pinned = set(self._free), set(self._cached), self._pinned
        if len(free_set) != len(self._free):
            raise RuntimeError("integrity: host tier free list has duplicate slots")
        if len(self._free) + len(cached_set) + len(pinned) != self._num_slots:
            raise RuntimeError(
                f"integrity: host tier free {len(self._free)} + cached {len(cached_set)} + "
                f"pinned {len(pinned)} != total {self._num_slots}"
            )
        for slot in range(self._num_slots):
            block_hash = self._hashes[slot]
            if (slot in free_set) + (slot in cached_set) + (slot in pinned) != 1:
                raise RuntimeError(f"integrity: host slot {slot} is not in exactly one state")
            if (block_hash is None) != (slot in free_set):
                raise RuntimeError(f"integrity: host slot {slot} hash/state mismatch")
            if block_hash is not None and self._hash_to_slot.get(block_hash) != slot:
                raise RuntimeError(f"integrity: host slot {slot}'s hash does not map back")
        if len(self._hash_to_slot) != len(cached_set) + len(pinned):
            raise RuntimeError("integrity: host tier hash map size != cached slots")
        self._cached.check_integrity()

    def _release(self, slot: SlotId) -> None:
        self._cached.remove(slot)  # type: ignore[arg-type]
        self._drop(slot)
        self._free.append(slot)

    def _drop(self, slot: SlotId) -> None:
        block_hash = self._hashes[slot]
        if block_hash is None:
            raise RuntimeError(f"host slot {slot} is cached without a hash")
        self._hashes[slot] = None
        del self._hash_to_slot[block_hash]
        self._cached.unhashed(slot)  # type: ignore[arg-type]


def check_tiers_disjoint(device_hashes: list[BlockHash], tier: HostTier) -> None:
    """Raise RuntimeError if a hash is registered both on the device and in the host tier."""
    both = [h for h in device_hashes if h in tier]
    if both:
        raise RuntimeError(f"integrity: {len(both)} hashes in both the device pool and host tier")
