"""BlockPool: states, ref counts, prefix-cache map, LRU eviction, events, integrity."""

from collections.abc import Callable
from typing import Any

import pytest

from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind, BlockId, BlockPool
from pagedserve.kvstore.hashing import BlockHash


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockPool:
    pool = BlockPool(num_blocks, block_size)
    pool.check_integrity()
    return pool


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "big"))


def ids(*values: int) -> list[BlockId]:
    return [BlockId(v) for v in values]


def do(pool: BlockPool, op: Callable[..., Any], *args: Any) -> Any:
    """Run one pool operation, then check every invariant."""
    result = op(*args)
    pool.check_integrity()
    return result


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_used, pool.num_cached


def cache_and_free(pool: BlockPool, block_hashes: dict[int, int]) -> None:
    """Allocate, register each block id → hash, and free in the dict's order."""
    got = do(pool, pool.allocate, len(block_hashes))
    assert got == list(block_hashes)
    for block_id, n in block_hashes.items():
        assert do(pool, pool.cache_block, block_id, h(n)) == block_id
    do(pool, pool.free, list(block_hashes))


def test_fresh_pool_allocates_in_increasing_id_order():
    pool = make_pool()
    assert do(pool, pool.allocate, 3) == [0, 1, 2]
    assert do(pool, pool.allocate, 2) == [3, 4]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert counts(pool) == (3, 5, 0)
    assert pool.usage == 5 / 8


def test_sizes_of_a_fresh_pool():
    pool = make_pool(num_blocks=6, block_size=16)
    assert (pool.num_blocks, pool.block_size) == (6, 16)
    assert counts(pool) == (6, 0, 0)
    assert pool.num_allocatable == 6
    assert pool.usage == 0.0


def test_allocate_zero_returns_empty_list():
    pool = make_pool()
    assert do(pool, pool.allocate, 0) == []
    assert counts(pool) == (8, 0, 0)


def test_negative_count_raises():
    pool = make_pool()
    with pytest.raises(ValueError, match="num_blocks"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.can_allocate(-1)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_bad_pool_sizes_raise(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_freed_blocks_return_to_the_free_list_tail_in_order():
    pool = make_pool(num_blocks=4)
    do(pool, pool.allocate, 4)
    do(pool, pool.free, ids(2, 0))
    assert counts(pool) == (2, 2, 0)
    assert do(pool, pool.allocate, 2) == [2, 0]


def test_free_list_is_fifo():
    pool = make_pool(num_blocks=4)
    do(pool, pool.allocate, 2)
    do(pool, pool.free, ids(1))
    # NOTE: 2 and 3 were never used and are ahead of the freed 1.
    assert do(pool, pool.allocate, 3) == [2, 3, 1]


def test_allocation_failure_returns_none_and_changes_nothing():
    pool = make_pool(num_blocks=4)
    cache_and_free(pool, {0: 10})
    do(pool, pool.allocate, 2)
    before = (counts(pool), [pool.ref_count(b) for b in range(4)], pool.lookup(h(10)))
    pool.drain_events()
    assert not pool.can_allocate(3)
    assert do(pool, pool.allocate, 3) is None
    assert (counts(pool), [pool.ref_count(b) for b in range(4)], pool.lookup(h(10))) == before
    assert pool.drain_events() == []


def test_can_allocate_counts_cached_blocks_and_changes_nothing():
    pool = make_pool(num_blocks=4)
    cache_and_free(pool, {0: 10, 1: 11})
    assert pool.num_allocatable == 4
    assert pool.can_allocate(4)
    assert counts(pool) == (2, 0, 2)
    assert pool.lookup(h(10)) == 0


def test_double_free_raises_and_changes_nothing():
    pool = make_pool()
    do(pool, pool.allocate, 2)
    do(pool, pool.free, ids(0))
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids(1, 0))
    pool.check_integrity()
    assert pool.ref_count(1) == 1


def test_freeing_one_block_twice_in_one_call_raises():
    pool = make_pool()
    do(pool, pool.allocate, 1)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(ids(0, 0))
    pool.check_integrity()
    assert pool.ref_count(0) == 1


def test_out_of_range_block_id_raises_value_error():
    pool = make_pool(num_blocks=4)
    with pytest.raises(ValueError, match="block_id"):
        pool.ref_count(BlockId(4))
    with pytest.raises(ValueError, match="block_id"):
        pool.free(ids(-1))


def test_acquire_and_free_count_references():
    pool = make_pool()
    do(pool, pool.allocate, 2)
    do(pool, pool.acquire, ids(1, 1))
    assert (pool.ref_count(0), pool.ref_count(1)) == (1, 3)
    do(pool, pool.free, ids(1, 1))
    assert pool.ref_count(1) == 1
    assert counts(pool) == (6, 2, 0)


def test_acquiring_a_free_block_raises_and_changes_nothing():
    pool = make_pool()
    do(pool, pool.allocate, 1)
    with pytest.raises(RuntimeError, match="FREE"):
        pool.acquire(ids(0, 5))
    pool.check_integrity()
    assert pool.ref_count(0) == 1


def test_freed_hashed_block_becomes_cached_and_lookup_finds_it():
    pool = make_pool()
    do(pool, pool.allocate, 2)
    assert do(pool, pool.cache_block, BlockId(0), h(1)) == 0
    do(pool, pool.free, ids(0, 1))
    assert counts(pool) == (7, 0, 1)
    assert pool.lookup(h(1)) == 0
    assert pool.block_hash(BlockId(0)) == h(1)
    assert pool.block_hash(BlockId(1)) is None
    assert pool.lookup(h(2)) is None


def test_acquire_revives_a_cached_block_as_a_prefix_hit():
    pool = make_pool()
    cache_and_free(pool, {0: 1})
    do(pool, pool.acquire, [pool.lookup(h(1))])
    assert counts(pool) == (7, 1, 0)
    assert pool.ref_count(0) == 1
    assert pool.block_hash(BlockId(0)) == h(1)
    do(pool, pool.free, ids(0))
    assert counts(pool) == (7, 0, 1)


def test_eviction_takes_free_blocks_first_then_least_recently_used_cached():
    pool = make_pool(num_blocks=4)
    # Cached in LRU order 2, 0, 1 (freed in that order); block 3 stays free.
    do(pool, pool.allocate, 3)
    for block_id, n in [(0, 10), (1, 11), (2, 12)]:
        do(pool, pool.cache_block, BlockId(block_id), h(n))
    do(pool, pool.free, ids(2, 0, 1))
    assert counts(pool) == (1, 0, 3)
    assert do(pool, pool.allocate, 3) == [3, 2, 0]
    assert pool.lookup(h(12)) is None
    assert pool.lookup(h(10)) is None
    assert pool.lookup(h(11)) == 1
    assert pool.block_hash(BlockId(2)) is None
    assert [pool.ref_count(b) for b in range(4)] == [1, 0, 1, 1]


def test_acquire_then_free_moves_block_to_most_recently_used_end():
    pool = make_pool(num_blocks=3)
    cache_and_free(pool, {0: 10, 1: 11, 2: 12})
    do(pool, pool.acquire, ids(0))
    do(pool, pool.free, ids(0))
    # LRU is now 1, 2, 0.
    assert do(pool, pool.allocate, 1) == [1]
    assert do(pool, pool.allocate, 1) == [2]
    assert do(pool, pool.allocate, 1) == [0]


def test_duplicate_hash_keeps_the_first_mapping():
    pool = make_pool()
    do(pool, pool.allocate, 2)
    assert do(pool, pool.cache_block, BlockId(0), h(7)) == 0
    assert do(pool, pool.cache_block, BlockId(1), h(7)) == 0
    assert pool.block_hash(BlockId(1)) is None
    assert pool.lookup(h(7)) == 0
    do(pool, pool.free, ids(1, 0))
    assert counts(pool) == (7, 0, 1)
    assert pool.drain_events() == [BlockEvent(BlockEventKind.STORED, h(7))]


def test_caching_a_block_again_under_its_own_hash_is_a_no_op():
    pool = make_pool()
    do(pool, pool.allocate, 1)
    do(pool, pool.cache_block, BlockId(0), h(7))
    pool.drain_events()
    assert do(pool, pool.cache_block, BlockId(0), h(7)) == 0
    assert pool.drain_events() == []


def test_rehashing_a_block_with_a_different_hash_raises():
    pool = make_pool()
    do(pool, pool.allocate, 1)
    do(pool, pool.cache_block, BlockId(0), h(7))
    with pytest.raises(RuntimeError, match="already has hash"):
        pool.cache_block(BlockId(0), h(8))
    pool.check_integrity()
    assert pool.lookup(h(8)) is None


def test_caching_an_unused_block_raises():
    pool = make_pool()
    with pytest.raises(RuntimeError, match="not used"):
        pool.cache_block(BlockId(0), h(1))
    pool.check_integrity()


def test_cache_block_rejects_a_hash_of_the_wrong_size():
    pool = make_pool()
    do(pool, pool.allocate, 1)
    with pytest.raises(ValueError, match="block_hash"):
        pool.cache_block(BlockId(0), BlockHash(b"short"))


def test_reset_prefix_cache_frees_cached_blocks_but_keeps_used_hashes():
    pool = make_pool(num_blocks=4)
    do(pool, pool.allocate, 3)
    for block_id in range(3):
        do(pool, pool.cache_block, BlockId(block_id), h(block_id))
    do(pool, pool.free, ids(1, 0))
    pool.drain_events()
    assert do(pool, pool.reset_prefix_cache) == 2
    assert counts(pool) == (3, 1, 0)
    assert (pool.lookup(h(0)), pool.lookup(h(1)), pool.lookup(h(2))) == (None, None, 2)
    assert pool.drain_events() == [
        BlockEvent(BlockEventKind.REMOVED, h(1)),
        BlockEvent(BlockEventKind.REMOVED, h(0)),
    ]
    # Reset blocks join the free-list tail, after the never-used block 3.
    do(pool, pool.free, ids(2))
    assert do(pool, pool.allocate, 3) == [3, 1, 0]


def test_events_record_stores_and_evictions_in_order_and_drain_clears():
    pool = make_pool(num_blocks=2)
    do(pool, pool.allocate, 2)
    do(pool, pool.cache_block, BlockId(0), h(1))
    do(pool, pool.cache_block, BlockId(1), h(2))
    do(pool, pool.free, ids(0, 1))
    do(pool, pool.allocate, 1)
    assert pool.drain_events() == [
        BlockEvent(BlockEventKind.STORED, h(1)),
        BlockEvent(BlockEventKind.STORED, h(2)),
        BlockEvent(BlockEventKind.REMOVED, h(1)),
    ]
    assert pool.drain_events() == []


def test_events_can_be_switched_off():
    pool = BlockPool(2, 4, record_events=False)
    pool.allocate(1)
    pool.cache_block(BlockId(0), h(1))
    assert pool.drain_events() == []


def test_check_integrity_detects_a_corrupted_free_list():
    pool = make_pool(num_blocks=4)
    do(pool, pool.allocate, 1)
    pool._free.append(BlockId(0))  # simulate a bookkeeping bug
    with pytest.raises(RuntimeError, match="integrity"):
        pool.check_integrity()
    pool._free.pop()
    pool.check_integrity()


def test_check_integrity_detects_a_stale_hash_map():
    pool = make_pool(num_blocks=4)
    do(pool, pool.allocate, 1)
    do(pool, pool.cache_block, BlockId(0), h(1))
    pool._hash_to_block[h(2)] = BlockId(0)  # simulate a bookkeeping bug
    with pytest.raises(RuntimeError, match="integrity"):
        pool.check_integrity()
    del pool._hash_to_block[h(2)]
    pool.check_integrity()
