"""KVCacheManager: prefix matching and reuse, ask-then-commit allocation, caching full blocks."""

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind, BlockId, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash, extend_block_hashes, hash_blocks
from pagedserve.kvstore.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4
FP = bytes(16)


def make_manager(num_blocks: int = 8, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        BlockPool(num_blocks, BLOCK_SIZE), enable_prefix_caching=enable_prefix_caching
    )


def hashes_of(tokens: list[int]) -> list[BlockHash]:
    return hash_blocks(tokens, BLOCK_SIZE, model_fingerprint=FP)


def do(manager: KVCacheManager, op: Callable[..., Any], *args: Any) -> Any:
    """Run one operation, then check every pool invariant."""
    result = op(*args)
    manager.check_integrity()
    return result


def run_prompt(manager: KVCacheManager, tokens: list[int]) -> BlockTable:
    """Admit a prompt with prefix reuse, 'compute' it, and cache its full blocks."""
    hashes = hashes_of(tokens)
    prefix = do(manager, manager.match_prefix, hashes, (len(tokens) - 1) // BLOCK_SIZE)
    table = BlockTable(manager.pool)
    assert do(manager, manager.allocate, table, len(tokens), prefix) == []
    do(manager, manager.cache_full_blocks, table, hashes, len(tokens))
    return table


def refs(manager: KVCacheManager) -> list[int]:
    return [manager.pool.ref_count(BlockId(b)) for b in range(manager.pool.num_blocks)]


def test_second_sequence_with_same_prefix_reuses_the_same_blocks():
    manager = make_manager()
    first = run_prompt(manager, list(range(10)))
    assert first.block_ids == [0, 1, 2]
    second = run_prompt(manager, list(range(8)) + [99, 98, 97])
    assert second.block_ids == [0, 1, 3]
    assert refs(manager)[:4] == [2, 2, 1, 1]
    assert second.num_cached_blocks == 2


def test_prefix_survives_the_first_sequence_as_cached_blocks():
    manager = make_manager()
    do(manager, manager.free, run_prompt(manager, list(range(10))))
    assert (manager.pool.num_cached, manager.pool.num_free) == (2, 6)
    second = run_prompt(manager, list(range(12)))
    assert second.block_ids == [0, 1, 3]
    assert (manager.pool.num_cached, manager.pool.num_used) == (0, 3)


def test_match_prefix_never_covers_the_whole_prompt():
    manager = make_manager()
    do(manager, manager.free, run_prompt(manager, list(range(8))))
    hashes = hashes_of(list(range(8)))
    assert manager.match_prefix(hashes) == [0, 1]
    assert manager.match_prefix(hashes, (8 - 1) // BLOCK_SIZE) == [0]
    second = run_prompt(manager, list(range(8)))
    assert second.block_ids == [0, 2]


def test_match_prefix_stops_at_the_first_miss():
    manager = make_manager()
    table = run_prompt(manager, list(range(12)))
    hashes = hashes_of(list(range(12)))
    assert manager.match_prefix([hashes[0], BlockHash(bytes(16)), hashes[2]]) == [0]
    assert manager.match_prefix([BlockHash(bytes(16)), hashes[1]]) == []
    assert manager.match_prefix(hashes, 0) == []
    do(manager, manager.free, table)


def test_match_prefix_rejects_negative_cap():
    manager = make_manager()
    with pytest.raises(ValueError, match="max_blocks"):
        manager.match_prefix([], -1)


def test_different_salt_gets_no_prefix_hit():
    manager = make_manager()
    tokens = list(range(9))
    do(manager, manager.free, run_prompt(manager, tokens))
    salted = hash_blocks(tokens, BLOCK_SIZE, model_fingerprint=FP, cache_salt="tenant-b")
    assert manager.match_prefix(salted) == []


def test_can_allocate_counts_cached_prefix_blocks_as_taken():
    manager = make_manager(num_blocks=4)
    do(manager, manager.free, run_prompt(manager, list(range(9))))
    assert (manager.pool.num_free, manager.pool.num_cached) == (2, 2)
    prefix = [BlockId(0), BlockId(1)]
    table = BlockTable(manager.pool)
    assert manager.can_allocate(table, 16, prefix)
    # 3 new blocks fit in 4 allocatable ones, but not once the 2 cached prefix blocks are taken.
    assert not manager.can_allocate(table, 17, prefix)
    assert do(manager, manager.allocate, table, 17, prefix) is None
    assert (table.block_ids, table.num_tokens) == ([], 0)
    assert (manager.pool.num_free, manager.pool.num_cached) == (2, 2)
    assert do(manager, manager.allocate, table, 16, prefix) == []
    assert table.block_ids == [0, 1, 3, 2]


def test_used_prefix_blocks_do_not_count_against_the_pool():
    manager = make_manager(num_blocks=4)
    first = run_prompt(manager, list(range(8)))
    table = BlockTable(manager.pool)
    assert manager.can_allocate(table, 16, first.block_ids)
    assert do(manager, manager.allocate, table, 16, first.block_ids) == []
    assert table.block_ids == [0, 1, 2, 3]
    assert refs(manager) == [2, 2, 1, 1]


def test_allocation_failure_returns_none_and_changes_nothing():
    manager = make_manager(num_blocks=4)
    table = run_prompt(manager, list(range(10)))
    events = manager.pool.drain_events()
    assert not manager.can_allocate(table, 17)
    assert do(manager, manager.allocate, table, 17) is None
    assert (table.block_ids, table.num_tokens) == ([0, 1, 2], 10)
    assert refs(manager) == [1, 1, 1, 0]
    assert manager.pool.drain_events() == []
    assert len(events) == 2


def test_allocate_grows_a_running_table_one_token_at_a_time():
    manager = make_manager()
    table = run_prompt(manager, list(range(7)))
    assert do(manager, manager.allocate, table, 8) == []
    assert table.block_ids == [0, 1]
    assert do(manager, manager.allocate, table, 9) == []
    assert (table.block_ids, table.num_tokens) == ([0, 1, 2], 9)
    assert do(manager, manager.allocate, table, 9) == []
    assert table.block_ids == [0, 1, 2]


def test_allocate_reports_copy_on_write_of_a_forked_table():
    manager = make_manager()
    parent = run_prompt(manager, list(range(6)))
    child = do(manager, parent.fork)
    assert do(manager, manager.allocate, child, 7) == [(1, 2)]
    assert (child.block_ids, parent.block_ids) == ([0, 2], [0, 1])
    assert refs(manager)[:3] == [2, 1, 1]


def test_prefix_on_a_non_empty_table_raises():
    manager = make_manager()
    first = run_prompt(manager, list(range(8)))
    table = run_prompt(manager, [50, 51])
    with pytest.raises(ValueError, match="prefix_blocks"):
        manager.allocate(table, 12, first.block_ids)
    manager.check_integrity()


def test_total_below_the_prefix_raises():
    manager = make_manager()
    first = run_prompt(manager, list(range(8)))
    with pytest.raises(ValueError, match="num_tokens_total"):
        manager.allocate(BlockTable(manager.pool), 7, first.block_ids)
    manager.check_integrity()


def test_cache_full_blocks_registers_only_fully_computed_blocks():
    manager = make_manager()
    tokens = list(range(10))
    hashes = hashes_of(tokens)
    table = BlockTable(manager.pool)
    do(manager, manager.allocate, table, 10)
    do(manager, manager.cache_full_blocks, table, hashes, 7)
    assert table.num_cached_blocks == 1
    assert [manager.pool.block_hash(b) for b in table.block_ids] == [hashes[0], None, None]
    do(manager, manager.cache_full_blocks, table, hashes, 10)
    assert table.num_cached_blocks == 2
    assert [manager.pool.block_hash(b) for b in table.block_ids] == [*hashes, None]
    assert manager.pool.drain_events() == [
        BlockEvent(BlockEventKind.STORED, hashes[0]),
        BlockEvent(BlockEventKind.STORED, hashes[1]),
    ]


def test_cache_full_blocks_is_capped_by_the_hashes_given():
    manager = make_manager()
    table = BlockTable(manager.pool)
    do(manager, manager.allocate, table, 8)
    hashes = hashes_of(list(range(8)))
    do(manager, manager.cache_full_blocks, table, hashes[:1], 8)
    assert table.num_cached_blocks == 1
    assert manager.pool.block_hash(table.block_ids[1]) is None


def test_cache_full_blocks_beyond_the_table_raises():
    manager = make_manager()
    table = BlockTable(manager.pool)
    do(manager, manager.allocate, table, 4)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.cache_full_blocks(table, hashes_of(list(range(8))), 8)


def test_same_prompt_computed_twice_keeps_the_first_blocks_registered():
    manager = make_manager()
    tokens = list(range(8))
    hashes = hashes_of(tokens)
    a, b = BlockTable(manager.pool), BlockTable(manager.pool)
    do(manager, manager.allocate, a, 8)
    do(manager, manager.allocate, b, 8)
    do(manager, manager.cache_full_blocks, a, hashes, 8)
    do(manager, manager.cache_full_blocks, b, hashes, 8)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert [manager.pool.lookup(x) for x in hashes] == [0, 1]
    do(manager, manager.free, b)
    assert (manager.pool.num_free, manager.pool.num_cached) == (6, 0)
    do(manager, manager.free, a)
    assert (manager.pool.num_free, manager.pool.num_cached) == (6, 2)


def test_prefix_caching_off_never_matches_or_registers():
    manager = make_manager(enable_prefix_caching=False)
    tokens = list(range(9))
    table = BlockTable(manager.pool)
    do(manager, manager.allocate, table, 9)
    do(manager, manager.cache_full_blocks, table, hashes_of(tokens), 9)
    assert table.num_cached_blocks == 0
    do(manager, manager.free, table)
    assert (manager.pool.num_free, manager.pool.num_cached) == (8, 0)
    assert manager.match_prefix(hashes_of(tokens)) == []
    assert manager.pool.drain_events() == []


def test_eviction_removes_the_tail_of_a_cached_sequence_first():
    manager = make_manager(num_blocks=4)
    do(manager, manager.free, run_prompt(manager, list(range(16))))
    assert manager.pool.num_cached == 4
    other = BlockTable(manager.pool)
    assert do(manager, manager.allocate, other, 4) == []
    assert other.block_ids == [3]
    assert manager.match_prefix(hashes_of(list(range(16)))) == [0, 1, 2]


# -- randomized property test -----------------------------------------------------------------


@dataclass
class Live:
    table: BlockTable
    tokens: list[int]
    hashes: list[BlockHash] = field(default_factory=list)

    def rehash(self) -> None:
        extend_block_hashes(self.hashes, self.tokens, BLOCK_SIZE, model_fingerprint=FP)


def check_against_live_tables(manager: KVCacheManager, live: list[Live]) -> None:
    manager.check_integrity()
    pool = manager.pool
    held = Counter(b for item in live for b in item.table.block_ids)
    for b in range(pool.num_blocks):
        assert pool.ref_count(BlockId(b)) == held[b], f"block {b}"
    for item in live:
        assert item.table.num_tokens == len(item.tokens)
        assert len(item.table.block_ids) == -(-len(item.tokens) // BLOCK_SIZE)
        for i, b in enumerate(item.table.block_ids):
            registered = pool.block_hash(b)
            assert registered is None or registered == item.hashes[i], "block holds other tokens"


def test_random_operations_keep_every_invariant():
    rng = random.Random(0)
    manager = make_manager(num_blocks=24)
    pool = manager.pool
    live: list[Live] = []
    prompts = [[rng.randrange(6) for _ in range(12)] for _ in range(3)]
    counts: Counter[str] = Counter()

    def admit() -> None:
        tokens = rng.choice(prompts)[: rng.randint(1, 12)] + [
            rng.randrange(6) for _ in range(rng.randint(0, 8))
        ]
        item = Live(BlockTable(pool), tokens)
        item.rehash()
        prefix = manager.match_prefix(item.hashes, (len(tokens) - 1) // BLOCK_SIZE)
        counts["prefix_blocks"] += len(prefix)
        if manager.allocate(item.table, len(tokens), prefix) is None:
            counts["refused"] += 1
        else:
            live.append(item)

    def append() -> None:
        item = rng.choice(live)
        new = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        copies = manager.allocate(item.table, len(item.tokens) + len(new))
        if copies is None:
            counts["refused"] += 1
            return
        for src, dst in copies:
            # The copy replaced the partial block the new tokens start in.
            assert item.table.block_ids[(len(item.tokens) - 1) // BLOCK_SIZE] == dst
            assert src not in item.table.block_ids
            assert pool.ref_count(dst) == 1
            assert pool.ref_count(src) >= 1
            counts["copies"] += 1
        item.tokens += new
        item.rehash()

    def cache() -> None:
        item = rng.choice(live)
        manager.cache_full_blocks(item.table, item.hashes, rng.randint(0, len(item.tokens)))

    def fork() -> None:
        item = rng.choice(live)
        live.append(Live(item.table.fork(), list(item.tokens), list(item.hashes)))

    def free() -> None:
        manager.free(live.pop(rng.randrange(len(live))).table)

    def reset() -> None:
        counts["reset_blocks"] += pool.reset_prefix_cache()

    ops = {admit: 6, append: 6, cache: 6, fork: 2, free: 5, reset: 1}
    for _ in range(4000):
        op = rng.choices(list(ops), list(ops.values()))[0]
        if not live and op not in (admit, reset):
            op = admit
        op()
        counts[op.__name__] += 1
        counts["removed"] += sum(e.kind is BlockEventKind.REMOVED for e in pool.drain_events())
        check_against_live_tables(manager, live)

    for item in live:
        manager.free(item.table)
    live.clear()
    check_against_live_tables(manager, live)
    assert pool.num_used == 0
    # The run must have exercised the interesting paths, or it proves nothing.
    assert counts["prefix_blocks"] > 100
    assert counts["copies"] > 10
    assert counts["reset_blocks"] > 0
    assert counts["removed"] > counts["reset_blocks"]  # evictions happened too
    assert counts["refused"] > 10
