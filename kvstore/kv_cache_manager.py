"""KVCacheManager: the scheduler's one entry point to KV blocks (prefix match, allocate, cache).

A request's life, in calls::

    hashes = hash_blocks(prompt, block_size, ...)                       # kvstore.hashing
    prefix = manager.match_prefix(hashes, (len(prompt) - 1) // block_size)
    copies = manager.allocate(table, num_tokens_total, prefix)          # None: wait / preempt
    ... run the model over tokens [len(prefix) * block_size, num_tokens_total) ...
    manager.cache_full_blocks(table, hashes, num_computed_tokens)
    manager.free(table)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.kvstore.block_pool import BlockId, BlockPool, Tier
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash

if TYPE_CHECKING:
    from pagedserve.kvstore.host_tier import OffloadCounts
    from pagedserve.kvstore.kv_offload import KVOffload


class KVCacheManager:
    """Allocates block tables from ``pool`` and offers their full blocks to the prefix cache.

    With ``enable_prefix_caching=False`` nothing is ever matched or registered, so every block
    returns to the free list when its table is freed.

    With ``offload`` (the host tier, ``--kv-offload-memory``, and the disk tier below it,
    ``--kv-offload-dir``), the pool's evicted cached blocks are copied to host memory (and on to
    disk) and ``match_prefix`` promotes them back; with
    ``promote_on_match=False`` only an explicit ``promote`` does (the decode engine promotes
    before it schedules a step, when no planned swap-out can still read a block it overwrites).
    """

    __slots__ = ("enable_prefix_caching", "offload", "pool", "promote_on_match")

    def __init__(
        self,
        pool: BlockPool,
        *,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
    ) -> None:
        self.pool = pool
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload if enable_prefix_caching else None
        self.promote_on_match = True
        pool.set_tier(self.offload)

    def match_prefix(
        self, block_hashes: Sequence[BlockHash], max_blocks: int | None = None
    ) -> list[BlockId]:
        """Blocks holding the longest leading run of ``block_hashes``, at most ``max_blocks``.

        No reference is taken, so pass the result to ``allocate`` before the pool changes.
        Without a host tier (or with ``promote_on_match=False``) there are no side effects. With
        one, the run continues into hashes the tier holds: ``promote`` first copies those
        blocks back into device blocks. The caller must leave at least one prompt token to
        compute (its logits give the first output token), i.e. pass ``max_blocks =
        (num_prompt_tokens - 1) // block_size``.
        """
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks: must be >= 0, got {max_blocks}")
        if not self.enable_prefix_caching:
            return []
        limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        if self.promote_on_match:
            self.promote(block_hashes, limit)
        return self._device_run(block_hashes[:limit], [])

    def promote(self, block_hashes: Sequence[BlockHash], max_blocks: int | None = None) -> int:
        """Promote the host tier's blocks that continue the device's leading run of
        ``block_hashes`` (at most ``max_blocks`` in all) into device blocks, now CACHED on the
        device with their hashes (the copies are complete on return); returns how many. May
        evict other cached blocks into the tier. 0 without a tier."""
        if self.offload is None:
            return 0
        limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        matched = self._device_run(block_hashes[:limit], [])
        if len(matched) == limit:
            return 0
        return self.offload.promote(self.pool, block_hashes[:limit], matched)

    def _device_run(
        self, block_hashes: Sequence[BlockHash], matched: list[BlockId]
    ) -> list[BlockId]:
        """``matched`` extended by the device blocks of the hashes that follow it."""
        matched = list(matched)
        for block_hash in block_hashes[len(matched) :]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def can_allocate(
        self,
        table: BlockTable,
        num_tokens_total: int,
        prefix_blocks: Sequence[BlockId] = (),
    ) -> bool:
        """Whether ``allocate`` with the same arguments would succeed now. Changes nothing.

        Cached prefix blocks count against the pool: acquiring them takes them out of the
        allocatable set.
        """
        needed = self._blocks_needed(table, num_tokens_total, prefix_blocks)
        revived = sum(1 for b in set(prefix_blocks) if self.pool.ref_count(b) == 0)
        return needed + revived <= self.pool.num_allocatable

    def allocate(
        self,
        table: BlockTable,
        num_tokens_total: int,
        prefix_blocks: Sequence[BlockId] = (),
    ) -> list[tuple[BlockId, BlockId]] | None:
        """Grow ``table`` to hold ``num_tokens_total`` tokens, starting it with ``prefix_blocks``.

        A table that already holds that many is left as it is (returns ``[]``).

        ``prefix_blocks`` (from ``match_prefix``) is allowed only on an empty table; it is
        acquired first, then new blocks are appended. Returns the block copies the caller must
        perform (see ``BlockTable.append_slots``), or None, changing nothing, if the pool is
        short.
        """
        if not self.can_allocate(table, num_tokens_total, prefix_blocks):
            return None
        if prefix_blocks:
            table.add_prefix(prefix_blocks)
        copies = table.append_slots(max(0, num_tokens_total - table.num_tokens))
        if copies is None:
            raise RuntimeError("allocate: pool ran short after can_allocate said it would not")
        return copies

    def cache_full_blocks(
        self, table: BlockTable, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register every block of ``table`` whose tokens are all computed and hashed.

        Block ``i`` is registered when ``i < num_computed_tokens // block_size`` and
        ``i < len(block_hashes)``; ``block_hashes[i]`` must be the hash of that block's tokens.
        A block whose hash another block already holds stays unregistered (see
        ``BlockPool.cache_block``); block ``i`` is registered at depth ``i``. No-op when prefix
        caching is off.
        """
        if num_computed_tokens > table.num_tokens:
            raise ValueError(
                f"num_computed_tokens: {num_computed_tokens} exceeds the table's "
                f"{table.num_tokens} slots"
            )
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.pool.block_size, len(block_hashes))
        for i in range(table.num_cached_blocks, num_full):
            self.pool.cache_block(table.block_ids[i], block_hashes[i], depth=i)
        table.num_cached_blocks = max(table.num_cached_blocks, num_full)

    def free(self, table: BlockTable) -> None:
        """Release the table's blocks (tail first); full registered ones stay cached."""
        table.free()

    def held_hashes(self) -> dict[BlockHash, Tier]:
        """Every hash a prefix match can serve now, with the tier that holds it (the device
        pool's, then the host and disk tiers'; a hash is in one tier): what the prefix index
        is republished from."""
        held = dict.fromkeys(self.pool.registered_hashes(), Tier.DEV)
        if self.offload is not None:
            held.update(self.offload.held_hashes())
        return held

    def check_integrity(self) -> None:
        """The pool's invariants and, with a host tier, the tier's and their disjointness."""
        self.pool.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity(self.pool)

    def _blocks_needed(
        self, table: BlockTable, num_tokens_total: int, prefix_blocks: Sequence[BlockId]
    ) -> int:
        if not prefix_blocks:
            return table.blocks_needed(num_tokens_total)
        if table.block_ids or table.num_tokens:
            raise ValueError(f"prefix_blocks: table already holds {table.num_tokens} tokens")
        prefix_tokens = len(prefix_blocks) * self.pool.block_size
        if num_tokens_total < prefix_tokens:
            raise ValueError(
                f"num_tokens_total: {num_tokens_total} is below the prefix's {prefix_tokens} tokens"
            )
        for block_id in prefix_blocks:
            if self.pool.block_hash(block_id) is None:
                raise ValueError(f"prefix_blocks: block {block_id} has no hash")
        return -(-num_tokens_total // self.pool.block_size) - len(prefix_blocks)


def offload_counts(kv: KVCacheManager) -> OffloadCounts | None:
    """The host tier's metrics, or None when the tier is off (no ``kv_offload_*`` series)."""
    return kv.offload.counts() if kv.offload is not None else None
