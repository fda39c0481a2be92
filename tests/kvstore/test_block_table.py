"""BlockTable: slots, growth, copy-on-write after fork, prefixes, free order."""

from collections.abc import Callable
from typing import Any

import pytest

from pagedserve.kvstore.block_pool import BlockId, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size)


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "big"))


def do(pool: BlockPool, op: Callable[..., Any], *args: Any) -> Any:
    """Run one operation, then check every pool invariant."""
    result = op(*args)
    pool.check_integrity()
    return result


def make_table(pool: BlockPool, num_tokens: int) -> BlockTable:
    table = BlockTable(pool)
    assert do(pool, table.append_slots, num_tokens) == []
    return table


def refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(BlockId(b)) for b in range(pool.num_blocks)]


def test_append_slots_allocates_blocks_only_when_the_last_one_fills():
    pool = make_pool()
    table = make_table(pool, 10)
    assert (table.block_ids, table.num_tokens) == ([0, 1, 2], 10)
    assert do(pool, table.append_slots, 2) == []
    assert table.block_ids == [0, 1, 2]
    assert do(pool, table.append_slots, 1) == []
    assert (table.block_ids, table.num_tokens) == ([0, 1, 2, 3], 13)
    assert refs(pool) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_append_zero_tokens_changes_nothing():
    pool = make_pool()
    table = make_table(pool, 0)
    assert (table.block_ids, table.num_tokens) == ([], 0)
    assert pool.num_used == 0


def test_negative_append_raises():
    pool = make_pool()
    table = BlockTable(pool)
    with pytest.raises(ValueError, match="num_new_tokens"):
        table.append_slots(-1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        table.can_append(-1)


def test_slots_follow_the_block_ids():
    pool = make_pool()
    do(pool, pool.allocate, 1)  # block 0 goes elsewhere, so ids and positions differ
    table = make_table(pool, 6)
    assert table.block_ids == [1, 2]
    assert [table.slot(p) for p in range(6)] == [4, 5, 6, 7, 8, 9]
    assert table.slot_mapping(2, 6) == [6, 7, 8, 9]
    assert table.slot_mapping(3, 3) == []


def test_slot_mapping_after_free_list_reordering():
    pool = make_pool(num_blocks=4)
    do(pool, pool.allocate, 4)
    do(pool, pool.free, [BlockId(3), BlockId(1)])
    table = make_table(pool, 5)
    assert table.block_ids == [3, 1]
    assert table.slot_mapping(0, 5) == [12, 13, 14, 15, 4]


@pytest.mark.parametrize("position", [-1, 6])
def test_slot_of_a_position_without_a_slot_raises(position):
    pool = make_pool()
    table = make_table(pool, 6)
    with pytest.raises(ValueError, match="position"):
        table.slot(position)


def test_slot_mapping_with_bad_range_raises():
    pool = make_pool()
    table = make_table(pool, 6)
    with pytest.raises(ValueError, match="start, end"):
        table.slot_mapping(4, 7)
    with pytest.raises(ValueError, match="start, end"):
        table.slot_mapping(3, 2)


def test_append_when_pool_is_short_returns_none_and_changes_nothing():
    pool = make_pool(num_blocks=3)
    table = make_table(pool, 10)
    assert not table.can_append(3)
    assert do(pool, table.append_slots, 3) is None
    assert (table.block_ids, table.num_tokens) == ([0, 1, 2], 10)
    assert table.can_append(2)


def test_blocks_needed_counts_growth_and_copy_on_write():
    pool = make_pool()
    table = make_table(pool, 6)
    assert [table.blocks_needed(n) for n in (0, 6, 7, 8, 9, 13)] == [0, 0, 0, 0, 1, 2]
    child = do(pool, table.fork)
    assert [table.blocks_needed(n) for n in (6, 7, 8, 9, 13)] == [0, 1, 1, 2, 3]
    do(pool, child.free)


def test_fork_shares_every_block():
    pool = make_pool()
    table = make_table(pool, 6)
    child = do(pool, table.fork)
    assert (child.block_ids, child.num_tokens) == ([0, 1], 6)
    assert refs(pool)[:3] == [2, 2, 0]
    assert child.block_ids is not table.block_ids


def test_append_to_a_shared_partial_block_copies_it_first():
    pool = make_pool()
    parent = make_table(pool, 6)
    child = do(pool, parent.fork)
    assert do(pool, parent.append_slots, 1) == [(1, 2)]
    assert (parent.block_ids, parent.num_tokens) == ([0, 2], 7)
    assert (child.block_ids, child.num_tokens) == ([0, 1], 6)
    assert refs(pool)[:4] == [2, 1, 1, 0]
    # The child is now the only holder of block 1 and writes in place.
    assert do(pool, child.append_slots, 2) == []
    assert (child.block_ids, child.num_tokens) == ([0, 1], 8)
    assert refs(pool)[:4] == [2, 1, 1, 0]


def test_copy_on_write_then_growth_in_one_append():
    pool = make_pool()
    parent = make_table(pool, 6)
    child = do(pool, parent.fork)
    assert do(pool, parent.append_slots, 5) == [(1, 2)]
    assert (parent.block_ids, parent.num_tokens) == ([0, 2, 3], 11)
    assert refs(pool)[:5] == [2, 1, 1, 1, 0]
    do(pool, child.free)
    assert refs(pool)[:5] == [1, 0, 1, 1, 0]


def test_shared_full_last_block_is_not_copied():
    pool = make_pool()
    parent = make_table(pool, 8)
    child = do(pool, parent.fork)
    assert do(pool, parent.append_slots, 1) == []
    assert parent.block_ids == [0, 1, 2]
    assert child.block_ids == [0, 1]
    assert refs(pool)[:3] == [2, 2, 1]


def test_copy_on_write_when_pool_is_short_returns_none_and_changes_nothing():
    pool = make_pool(num_blocks=2)
    parent = make_table(pool, 6)
    do(pool, parent.fork)
    assert not parent.can_append(1)
    assert do(pool, parent.append_slots, 1) is None
    assert (parent.block_ids, parent.num_tokens) == ([0, 1], 6)
    assert refs(pool) == [2, 2]


def test_add_prefix_acquires_cached_blocks():
    pool = make_pool()
    first = make_table(pool, 8)
    do(pool, pool.cache_block, BlockId(0), h(0))
    do(pool, pool.cache_block, BlockId(1), h(1))
    do(pool, first.free)
    assert (pool.num_cached, pool.num_used) == (2, 0)
    table = BlockTable(pool)
    do(pool, table.add_prefix, [BlockId(0), BlockId(1)])
    assert (table.block_ids, table.num_tokens, table.num_cached_blocks) == ([0, 1], 8, 2)
    assert refs(pool)[:2] == [1, 1]
    assert (pool.num_cached, pool.num_used) == (0, 2)
    assert do(pool, table.append_slots, 1) == []
    assert table.block_ids == [0, 1, 2]


def test_add_prefix_on_a_non_empty_table_raises():
    pool = make_pool()
    table = make_table(pool, 4)
    do(pool, pool.cache_block, BlockId(0), h(0))
    with pytest.raises(ValueError, match="add_prefix"):
        table.add_prefix([BlockId(0)])
    assert pool.ref_count(BlockId(0)) == 1


def test_add_prefix_with_an_unhashed_block_raises_and_changes_nothing():
    pool = make_pool()
    other = make_table(pool, 8)
    do(pool, pool.cache_block, BlockId(0), h(0))
    table = BlockTable(pool)
    with pytest.raises(ValueError, match="block 1 has no hash"):
        table.add_prefix([BlockId(0), BlockId(1)])
    assert refs(pool)[:2] == [1, 1]
    assert table.block_ids == []
    do(pool, other.free)


def test_free_releases_blocks_tail_first():
    pool = make_pool(num_blocks=4)
    table = make_table(pool, 12)
    do(pool, table.free)
    assert (table.block_ids, table.num_tokens) == ([], 0)
    # Never-used block 3 first, then the table's blocks in reverse.
    assert do(pool, pool.allocate, 4) == [3, 2, 1, 0]


def test_free_puts_the_tail_at_the_eviction_end_of_the_cache():
    pool = make_pool(num_blocks=3)
    table = make_table(pool, 12)
    for i in range(3):
        do(pool, pool.cache_block, BlockId(i), h(i))
    do(pool, table.free)
    assert pool.num_cached == 3
    assert do(pool, pool.allocate, 1) == [2]
    assert do(pool, pool.allocate, 1) == [1]
    assert pool.lookup(h(0)) == 0


def test_freed_table_can_be_reused():
    pool = make_pool()
    table = make_table(pool, 5)
    do(pool, table.free)
    assert do(pool, table.append_slots, 3) == []
    assert (table.block_ids, table.num_tokens) == ([2], 3)
