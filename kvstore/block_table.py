"""BlockTable: the ordered KV blocks of one sequence, and the slot of each of its tokens.

::

    block_ids:  [ b0        | b1        | b2    ....]     block_size = 4, num_tokens = 10
    positions:    0  1  2  3  4  5  6  7  8  9            slot(p) = block_ids[p // 4] * 4 + p % 4

Invariant: ``len(block_ids) == ceil(num_tokens / block_size)``; only the last block may be partial.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.kvstore.block_pool import BlockId, BlockPool


class BlockTable:
    """The blocks of ONE sequence, each holding one reference in ``pool``.

    Contracts:
    - The table owns one pool reference per entry of ``block_ids``; ``free`` returns them all.
      Dropping a table without ``free`` leaks its blocks.
    - Only tokens beyond ``num_tokens`` are ever written, so full blocks may be shared (prefix
      hits, forks); a shared partial last block is copied before it is written
      (``append_slots`` reports the copy, the caller copies the KV).
    - ``num_cached_blocks`` is how many leading blocks have been offered to the prefix cache;
      it is maintained by ``KVCacheManager``.
    """

    __slots__ = ("block_ids", "num_cached_blocks", "num_tokens", "pool")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_ids: list[BlockId] = []
        self.num_tokens = 0
        self.num_cached_blocks = 0

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def blocks_needed(self, num_tokens_total: int) -> int:
        """New blocks needed so that ``num_tokens_total`` tokens have a slot.

        Counts the copy-on-write of a shared partial last block as one block. Zero when the
        table already holds ``num_tokens_total`` tokens (tables shrink only by ``truncate``).
        """
        if num_tokens_total <= self.num_tokens:
            return 0
        grow = _cdiv(num_tokens_total, self.block_size) - len(self.block_ids)
        return grow + int(self._last_block_is_shared())

    def can_append(self, num_new_tokens: int) -> bool:
        """Whether ``append_slots(num_new_tokens)`` would succeed now. Changes nothing."""
        _check_new_tokens(num_new_tokens)
        return self.pool.can_allocate(self.blocks_needed(self.num_tokens + num_new_tokens))

    def append_slots(self, num_new_tokens: int) -> list[tuple[BlockId, BlockId]] | None:
        """Give slots to ``num_new_tokens`` more tokens, allocating blocks as needed.

        Returns the block copies ``(src, dst)`` the caller must perform before writing (a
        copy-on-write of a shared partial last block: ``dst`` replaces ``src`` in this table and
        one reference to ``src`` is dropped); usually empty. Returns None, changing nothing, if
        the pool is short.
        """
        _check_new_tokens(num_new_tokens)
        if num_new_tokens == 0:
            return []
        new_blocks = self.pool.allocate(self.blocks_needed(self.num_tokens + num_new_tokens))
        if new_blocks is None:
            return None
        copies: list[tuple[BlockId, BlockId]] = []
        if self._last_block_is_shared():
            src, dst = self.block_ids[-1], new_blocks.pop(0)
            self.block_ids[-1] = dst
            self.pool.free([src])
            copies.append((src, dst))
        self.block_ids.extend(new_blocks)
        self.num_tokens += num_new_tokens
        return copies

    def add_prefix(self, block_ids: Sequence[BlockId]) -> None:
        """Start an EMPTY table with the given full, hashed blocks (a prefix-cache hit).

        Takes one reference to each (cached blocks leave the LRU) and sets ``num_tokens`` to
        ``len(block_ids) * block_size``. Raises ValueError on a non-empty table or an unhashed
        block.
        """
        if self.block_ids or self.num_tokens:
            raise ValueError(f"add_prefix: table already holds {self.num_tokens} tokens")
        for block_id in block_ids:
            if self.pool.block_hash(block_id) is None:
                raise ValueError(f"block_ids: block {block_id} has no hash, not a cached prefix")
        self.pool.acquire(block_ids)
        self.block_ids = list(block_ids)
        self.num_tokens = len(block_ids) * self.block_size
        self.num_cached_blocks = len(block_ids)

    def slot(self, position: int) -> int:
        """The KV slot of token ``position``; ValueError if that token has no slot."""
        if not 0 <= position < self.num_tokens:
            raise ValueError(f"position: must be in [0, {self.num_tokens}), got {position}")
        block_size = self.block_size
        return self.block_ids[position // block_size] * block_size + position % block_size

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end-1``; ValueError unless 0 <= start <= end <= num_tokens."""
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(
                f"start, end: need 0 <= start <= end <= {self.num_tokens}, got {start}, {end}"
            )
        block_size = self.block_size
        return [
            self.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
        ]

    def truncate(self, num_tokens: int) -> None:
        """Keep slots for the first ``num_tokens`` tokens only (speculative decoding drops the
        slots of rejected proposals): blocks wholly past them are released, last first.

        Contract: the released blocks hold no token anyone computed and kept, so none has a
        hash (only computed full blocks are cached); ValueError if ``num_tokens`` is negative or
        would drop a cached block.
        """
        keep = _cdiv(num_tokens, self.block_size)
        if not 0 <= num_tokens <= self.num_tokens or keep < self.num_cached_blocks:
            raise ValueError(
                f"num_tokens: must be in [0, {self.num_tokens}] and keep the table's "
                f"{self.num_cached_blocks} cached blocks, got {num_tokens}"
            )
        self.pool.free(reversed(self.block_ids[keep:]))
        del self.block_ids[keep:]
        self.num_tokens = num_tokens

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (one more reference each)."""
        child = BlockTable(self.pool)
        self.pool.acquire(self.block_ids)
        child.block_ids = list(self.block_ids)
        child.num_tokens = self.num_tokens
        child.num_cached_blocks = self.num_cached_blocks
        return child

    def free(self) -> None:
        """Release every block, last block first, and leave the table empty and reusable.

        NOTE: reverse order puts the tail of the sequence at the least-recently-used end of the
        cache, so eviction eats a sequence from its tail and the shared head survives longest.
        """
        self.pool.free(reversed(self.block_ids))
        self.block_ids = []
        self.num_tokens = 0
        self.num_cached_blocks = 0

    def _last_block_is_shared(self) -> bool:
        return (
            self.num_tokens % self.block_size != 0 and self.pool.ref_count(self.block_ids[-1]) > 1
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_new_tokens(num_new_tokens: int) -> None:
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens: must be >= 0, got {num_new_tokens}")
