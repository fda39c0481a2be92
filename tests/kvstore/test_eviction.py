"""Eviction policies of BlockPool: lru as it always was, hits (decayed hits, depth, recency)."""

import random
from collections.abc import Callable
from typing import Any

import pytest

from pagedserve.kvstore.block_pool import BlockEventKind, BlockId, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.eviction import (
    DEFAULT_EVICTION_POLICY,
    EvictionPolicy,
    HitsEvictor,
    parse_eviction_policy,
)
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.kv_cache_manager import KVCacheManager


def make_pool(num_blocks: int = 8, policy: str = "hits") -> BlockPool:
    pool = BlockPool(num_blocks, 4, eviction_policy=policy)
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


def cache_chain(pool: BlockPool, first_hash: int, length: int) -> list[BlockId]:
    """Allocate ``length`` blocks and register them as one chain (block i at depth i)."""
    got = do(pool, pool.allocate, length)
    for depth, block_id in enumerate(got):
        do(pool, pool.cache_block, block_id, h(first_hash + depth), depth)
    return got


def evicted(pool: BlockPool, num_blocks: int) -> list[BlockHash]:
    """Hashes that allocating ``num_blocks`` more blocks evicts, in eviction order."""
    pool.drain_events()
    assert do(pool, pool.allocate, num_blocks) is not None
    return [e.block_hash for e in pool.drain_events() if e.kind is BlockEventKind.REMOVED]


def test_hits_evicts_a_chain_leaf_first_even_when_released_root_first():
    pool = make_pool(num_blocks=4)
    chain = cache_chain(pool, 10, 4)
    do(pool, pool.free, chain)  # root first: LRU would evict the root first
    assert evicted(pool, 4) == [h(13), h(12), h(11), h(10)]


def test_lru_evicts_the_same_chain_in_release_order():
    pool = make_pool(num_blocks=4, policy="lru")
    chain = cache_chain(pool, 10, 4)
    do(pool, pool.free, chain)
    assert evicted(pool, 4) == [h(10), h(11), h(12), h(13)]


def test_hits_keeps_a_hot_block_that_lru_would_evict_first():
    for policy, expected in [("hits", [h(2), h(1)]), ("lru", [h(1), h(2)])]:
        pool = make_pool(num_blocks=2, policy=policy)
        hot = cache_chain(pool, 1, 1)
        do(pool, pool.acquire, hot)  # two prefix hits while in use
        do(pool, pool.acquire, hot)
        do(pool, pool.free, hot * 3)  # hot is released first: older for LRU
        cold = cache_chain(pool, 2, 1)
        do(pool, pool.free, cold)
        assert evicted(pool, 2) == expected, policy


def test_a_hit_on_a_cached_block_counts_and_revives_it():
    pool = make_pool(num_blocks=3)
    a, b, c = (cache_chain(pool, n, 1)[0] for n in (1, 2, 3))
    do(pool, pool.free, [a, b, c])
    do(pool, pool.acquire, [a])  # a prefix hit on a CACHED block
    do(pool, pool.free, [a])
    assert evicted(pool, 3) == [h(2), h(3), h(1)]


def test_without_hits_or_depths_hits_evicts_in_lru_order():
    pool = make_pool(num_blocks=4)
    got = do(pool, pool.allocate, 4)
    for block_id in got:
        do(pool, pool.cache_block, block_id, h(block_id))
    do(pool, pool.free, ids(2, 0))
    do(pool, pool.free, ids(3, 1))
    assert evicted(pool, 4) == [h(2), h(0), h(3), h(1)]


def test_hits_decay_so_a_block_once_hot_is_evicted_after_enough_churn():
    pool = BlockPool(4, 4, eviction_policy="hits")
    old = cache_chain(pool, 1, 1)
    do(pool, pool.acquire, old)
    do(pool, pool.free, old * 2)  # 1 hit: lives about half_life (4) ticks longer than a new block
    for _ in range(3):  # 3 x 3 = 9 blocks allocated: the one hit has decayed past its bonus
        do(pool, pool.free, do(pool, pool.allocate, 3))
    fresh = cache_chain(pool, 2, 1)
    do(pool, pool.free, fresh)
    assert evicted(pool, 4)[:2] == [h(1), h(2)]


def test_one_hit_outlives_a_newer_block_within_its_half_life():
    pool = BlockPool(4, 4, eviction_policy="hits")
    old = cache_chain(pool, 1, 1)
    do(pool, pool.acquire, old)
    do(pool, pool.free, old * 2)
    do(pool, pool.free, do(pool, pool.allocate, 2))  # 2 ticks < half_life 4
    fresh = cache_chain(pool, 2, 1)
    do(pool, pool.free, fresh)
    assert evicted(pool, 4)[:2] == [h(2), h(1)]


def test_a_rehashed_block_starts_with_no_hits():
    pool = make_pool(num_blocks=2)
    hot = cache_chain(pool, 1, 1)
    do(pool, pool.acquire, hot * 3)
    do(pool, pool.free, hot * 4)
    other = cache_chain(pool, 2, 1)
    do(pool, pool.free, other)
    assert evicted(pool, 1) == [h(2)]
    do(pool, pool.free, other)  # the unhashed block goes back to the free list
    assert evicted(pool, 2) == [h(1)]  # the free block first, then the hot one
    do(pool, pool.free, ids(0, 1))
    reborn = cache_chain(pool, 3, 2)  # block 0 again, under a new hash: its hits are gone
    do(pool, pool.free, reborn[::-1])
    assert evicted(pool, 2) == [h(4), h(3)]


def test_reset_prefix_cache_frees_every_cached_block_under_hits():
    pool = make_pool(num_blocks=4)
    chain = cache_chain(pool, 10, 3)
    do(pool, pool.free, chain)
    pool.drain_events()
    assert do(pool, pool.reset_prefix_cache) == 3
    assert (pool.num_free, pool.num_used, pool.num_cached) == (4, 0, 0)
    assert [e.block_hash for e in pool.drain_events()] == [h(12), h(11), h(10)]


def test_manager_registers_each_block_at_its_index():
    pool = make_pool(num_blocks=4)
    manager = KVCacheManager(pool)
    table = BlockTable(pool)
    assert manager.allocate(table, 12) == []
    manager.cache_full_blocks(table, [h(1), h(2), h(3)], 12)
    do(pool, pool.free, list(table.block_ids))  # root first, unlike BlockTable.free
    assert evicted(pool, 4) == [h(3), h(2), h(1)]


def test_stale_heap_entries_are_compacted():
    pool = make_pool(num_blocks=4)
    block = cache_chain(pool, 1, 1)
    do(pool, pool.free, block)
    for _ in range(500):
        pool.acquire(block)
        pool.free(block)
    pool.check_integrity()
    evictor = pool._cached
    assert isinstance(evictor, HitsEvictor)
    assert len(evictor._heap) <= 2 * len(evictor) + 64


def test_policy_names_and_defaults():
    assert parse_eviction_policy("lru") is EvictionPolicy.LRU
    assert parse_eviction_policy(EvictionPolicy.HITS) is EvictionPolicy.HITS
    assert BlockPool(2, 4).eviction_policy is EvictionPolicy.LRU  # a bare pool: as it always was
    assert make_pool(policy="hits").eviction_policy is EvictionPolicy.HITS
    assert DEFAULT_EVICTION_POLICY is EvictionPolicy.HITS
    with pytest.raises(ValueError, match="eviction_policy: unknown 'lfu'"):
        BlockPool(2, 4, eviction_policy="lfu")


def test_bad_depth_and_half_life_raise():
    pool = make_pool()
    do(pool, pool.allocate, 1)
    with pytest.raises(ValueError, match="depth"):
        pool.cache_block(BlockId(0), h(1), -1)
    with pytest.raises(ValueError, match="half_life"):
        HitsEvictor(4, half_life=0)


# -- random operation sequences ----------------------------------------------------------------


class Shadow:
    """What the hits policy must evict next, by brute force over every cached block."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.keys: dict[BlockId, tuple[float, int, int]] = {}
        self.depth: dict[BlockId, int] = {}
        self.seq = 0

    def released(self, block_ids: list[BlockId]) -> None:
        evictor = self.pool._cached
        assert isinstance(evictor, HitsEvictor)
        for block_id in block_ids:
            if self.pool.ref_count(block_id) == 0 and self.pool.block_hash(block_id) is not None:
                self.seq += 1
                key = evictor.key(block_id)
                self.keys[block_id] = (key, -self.depth.get(block_id, 0), self.seq)

    def next_victims(self, num_blocks: int) -> list[BlockId]:
        num_evicted = max(0, num_blocks - self.pool.num_free)
        return sorted(self.keys, key=self.keys.__getitem__)[:num_evicted]


def _random_step(pool: BlockPool, rng: random.Random, held: list[BlockId], shadow, counter):
    op = rng.choice(["allocate", "allocate", "cache", "acquire", "free", "free", "reset"])
    if op == "allocate":
        n = rng.randint(0, 3)
        expected = shadow.next_victims(n) if shadow and pool.can_allocate(n) else None
        got = do(pool, pool.allocate, n)
        if got is not None:
            if expected is not None:
                assert set(got) >= set(expected)
                assert [b for b in got if b in shadow.keys] == expected
                for block_id in expected:
                    del shadow.keys[block_id]
            held.extend(got)
    elif op == "cache" and held:
        block_id = rng.choice(held)
        if pool.block_hash(block_id) is None:
            depth = rng.randint(0, 5)
            counter[0] += 1
            if do(pool, pool.cache_block, block_id, h(counter[0]), depth) == block_id and shadow:
                shadow.depth[block_id] = depth
    elif op == "acquire":
        candidates = sorted(set(held) | set(pool._cached))
        if candidates:
            block_id = rng.choice(candidates)
            do(pool, pool.acquire, [block_id])
            held.append(block_id)
            if shadow:
                shadow.keys.pop(block_id, None)
    elif op == "free" and held:
        victims = [held.pop(rng.randrange(len(held))) for _ in range(rng.randint(1, len(held)))]
        do(pool, pool.free, victims)
        if shadow:
            shadow.released(victims)
    elif op == "reset" and rng.random() < 0.1:
        do(pool, pool.reset_prefix_cache)
        if shadow:
            shadow.keys.clear()


@pytest.mark.parametrize("policy", ["lru", "hits"])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_invariant(policy, seed):
    rng = random.Random(seed)
    pool = make_pool(num_blocks=16, policy=policy)
    shadow = Shadow(pool) if policy == "hits" else None
    held: list[BlockId] = []
    counter = [0]
    for _ in range(400):
        _random_step(pool, rng, held, shadow, counter)
        assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks
        assert pool.num_allocatable == pool.num_free + pool.num_cached
        if shadow:
            assert set(shadow.keys) == set(pool._cached)
    do(pool, pool.free, held)
    assert pool.num_used == 0
