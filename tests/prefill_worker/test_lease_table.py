"""LeaseTable: grant/renew/release/reap with a fake clock, exactly-once release, the reaper thread,
and leased blocks returning to the prefix cache of a real BlockPool."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import hash_blocks
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.prefill_worker.lease_table import (
    Lease,
    LeaseReaper,
    LeaseState,
    LeaseStats,
    LeaseTable,
)

BOUND_S = 2.0  # a wait that must end well within this (a bound, not a speed check)


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A ``release_fn`` that remembers every call, thread-safely."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, lease: Lease[str]) -> None:
        with self._lock:
            self.calls.append(lease.handle_id)


def make_table(clock: FakeClock | None = None) -> tuple[LeaseTable[str], Recorder, FakeClock]:
    clock = clock or FakeClock()
    recorder = Recorder()
    return LeaseTable(recorder, clock=clock), recorder, clock


def test_grant_gives_a_random_128_bit_handle_and_an_absolute_expiry() -> None:
    table, _, clock = make_table()
    a = table.grant("req-a", "blocks-a", ttl_s=30)
    b = table.grant("req-b", "blocks-b", ttl_s=5, now=200.0)
    assert len(a.handle_id) == 32 and int(a.handle_id, 16) >= 0
    assert a.handle_id != b.handle_id
    assert (a.request_id, a.resource, a.granted_at, a.expires_at) == ("req-a", "blocks-a", 100, 130)
    assert b.expires_at == 205.0
    assert table.get(a.handle_id) == a
    assert len(table) == 2
    assert table.stats() == LeaseStats(granted=2, released=0, expired=0, active=2)


def test_get_returns_none_once_expired_even_before_reaping() -> None:
    table, recorder, clock = make_table()
    lease = table.grant("req", "blocks", ttl_s=10)
    assert table.get(lease.handle_id, now=109.999) == lease
    clock.now = 110.0
    assert table.get(lease.handle_id) is None
    assert table.get("no-such-handle") is None
    assert recorder.calls == []  # nothing freed until reap or release


def test_renew_extends_to_the_later_of_current_and_now_plus_extend() -> None:
    table, _, clock = make_table()
    lease = table.grant("req", "blocks", ttl_s=30)  # expires 130
    assert table.renew(lease.handle_id, 10) == 130.0  # 110 < 130: unchanged, never shortened
    clock.now = 125.0
    assert table.renew(lease.handle_id, 10) == 135.0
    renewed = table.get(lease.handle_id)
    assert renewed is not None and renewed.expires_at == 135.0
    assert renewed.granted_at == 100.0
    assert table.renew("no-such-handle", 10) is None
    with pytest.raises(ValueError, match="extend_s"):
        table.renew(lease.handle_id, 0)


def test_expired_or_released_lease_cannot_be_renewed() -> None:
    table, _, clock = make_table()
    expired = table.grant("a", "x", ttl_s=1)
    released = table.grant("b", "y", ttl_s=100)
    assert table.release(released.handle_id)
    clock.now = 101.0
    assert table.renew(expired.handle_id, 60) is None
    assert table.renew(released.handle_id, 60) is None


def test_release_is_idempotent_and_frees_once() -> None:
    table, recorder, _ = make_table()
    lease = table.grant("req", "blocks", ttl_s=30)
    assert table.release(lease.handle_id) is True
    assert table.release(lease.handle_id) is False
    assert table.release("no-such-handle") is False
    assert recorder.calls == [lease.handle_id]
    assert table.get(lease.handle_id) is None
    assert table.reap(now=1e9) == []
    assert table.stats() == LeaseStats(granted=1, released=1, expired=0, active=0)


def test_release_request_frees_every_lease_of_that_request_once() -> None:
    table, recorder, _ = make_table()
    first, other, second = (table.grant(r, "blocks", ttl_s=30) for r in ("req", "other", "req"))
    assert table.release_request("req") == 2
    assert table.release_request("req") == 0
    assert table.release_request("no-such-request") == 0
    assert sorted(recorder.calls) == sorted([first.handle_id, second.handle_id])
    assert table.get(other.handle_id) is other
    assert table.stats() == LeaseStats(granted=3, released=2, expired=0, active=1)


def test_reap_frees_expired_leases_in_expiry_order() -> None:
    table, recorder, clock = make_table()
    a = table.grant("a", "x", ttl_s=5)  # 105
    b = table.grant("b", "y", ttl_s=1)  # 101
    c = table.grant("c", "z", ttl_s=3)  # 103
    assert table.reap(now=100.5) == []
    assert table.next_expiry() == 101.0
    assert table.reap(now=103.0) == [b, c]  # expires_at <= now is expired
    assert recorder.calls == [b.handle_id, c.handle_id]
    assert table.get(a.handle_id) == a
    clock.now = 110.0
    assert table.reap() == [a]
    assert table.next_expiry() is None
    assert table.stats() == LeaseStats(granted=3, released=0, expired=3, active=0)


def test_renewed_lease_is_reaped_at_its_new_expiry_only() -> None:
    table, recorder, clock = make_table()
    lease = table.grant("req", "blocks", ttl_s=1)  # 101
    clock.now = 100.5
    assert table.renew(lease.handle_id, 9.5) == 110.0
    assert table.reap(now=105.0) == []
    assert table.next_expiry() == 110.0
    (reaped,) = table.reap(now=110.0)
    assert (reaped.handle_id, reaped.expires_at) == (lease.handle_id, 110.0)
    assert recorder.calls == [lease.handle_id]


def test_many_renewals_keep_the_heap_bounded() -> None:
    table, _, clock = make_table()
    lease = table.grant("req", "blocks", ttl_s=1)
    for _ in range(1000):
        clock.now += 0.5
        assert table.renew(lease.handle_id, 1) is not None
    assert len(table._heap) <= 2 * len(table) + 65
    assert table.reap(now=clock.now + 1) != []


def test_release_of_an_expired_unreaped_lease_frees_it_once() -> None:
    table, recorder, clock = make_table()
    lease = table.grant("req", "blocks", ttl_s=1)
    clock.now = 200.0
    assert table.release(lease.handle_id) is True
    assert table.reap() == []
    assert recorder.calls == [lease.handle_id]


def test_release_fn_runs_exactly_once_under_concurrent_release_and_reap() -> None:
    table, recorder, clock = make_table()
    leases = [table.grant(f"r{i}", f"t{i}", ttl_s=1 + i % 7) for i in range(400)]
    clock.now = 105.0  # about two thirds have expired
    start = threading.Barrier(5)
    results: list[list[bool]] = []

    def releaser(seed: int) -> None:
        order = [lease.handle_id for lease in leases]
        random.Random(seed).shuffle(order)
        start.wait()
        results.append([table.release(h) for h in order])

    def reaper() -> None:
        start.wait()
        for _ in range(200):
            table.reap()

    threads = [threading.Thread(target=releaser, args=(seed,)) for seed in range(4)]
    threads.append(threading.Thread(target=reaper))
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S * 5)
    assert not any(t.is_alive() for t in threads)

    assert Counter(recorder.calls) == Counter({lease.handle_id: 1 for lease in leases})
    stats = table.stats()
    assert stats.released + stats.expired == 400
    assert stats.released == sum(sum(r) for r in results)
    assert stats.active == 0


def test_a_failing_release_fn_does_not_stop_the_others_from_being_reaped() -> None:
    freed: list[str] = []

    def release_fn(lease: Lease[str]) -> None:
        if lease.resource == "bad":
            raise RuntimeError("boom")
        freed.append(lease.resource)

    table: LeaseTable[str] = LeaseTable(release_fn, clock=FakeClock())
    for resource in ["a", "bad", "c"]:
        table.grant("req", resource, ttl_s=1)
    with pytest.raises(RuntimeError, match="boom"):
        table.reap(now=200.0)
    assert freed == ["a", "c"]
    assert len(table) == 0


def test_bad_grants_are_value_errors() -> None:
    table, _, _ = make_table()
    with pytest.raises(ValueError, match="ttl_s"):
        table.grant("req", "blocks", ttl_s=0)
    with pytest.raises(ValueError, match="request_id"):
        table.grant("", "blocks", ttl_s=1)


def test_reaper_thread_frees_a_lease_at_its_expiry_and_stops_promptly() -> None:
    reaped = threading.Event()
    table: LeaseTable[str] = LeaseTable(lambda lease: reaped.set())
    reaper = LeaseReaper(table, max_wait_s=10.0)  # sleeps until the next expiry, not 10 s
    table.grant("req", "blocks", ttl_s=0.05)
    reaper.start()
    try:
        assert reaped.wait(BOUND_S)
        assert len(table) == 0
    finally:
        assert reaper.stop(timeout_s=BOUND_S)


def test_reaper_stop_returns_without_waiting_out_its_sleep() -> None:
    table: LeaseTable[str] = LeaseTable(lambda lease: None)
    reaper = LeaseReaper(table, max_wait_s=3600)
    reaper.start()
    assert reaper.stop(timeout_s=BOUND_S)


# -- with a real pool ----------------------------------------------------------------------------

BLOCK_SIZE = 4
FP = bytes(16)


def prefill(manager: KVCacheManager, tokens: list[int]) -> BlockTable:
    """Allocate and 'compute' a prompt with prefix reuse, caching its full blocks."""
    hashes = hash_blocks(tokens, BLOCK_SIZE, model_fingerprint=FP)
    prefix = manager.match_prefix(hashes, (len(tokens) - 1) // BLOCK_SIZE)
    table = BlockTable(manager.pool)
    assert manager.allocate(table, len(tokens), prefix) is not None
    manager.cache_full_blocks(table, hashes, len(tokens))
    manager.check_integrity()
    return table


def make_leased_pool() -> tuple[KVCacheManager, LeaseTable[BlockTable], FakeClock]:
    manager = KVCacheManager(BlockPool(8, BLOCK_SIZE))
    clock = FakeClock()
    table: LeaseTable[BlockTable] = LeaseTable(
        lambda lease: manager.free(lease.resource), clock=clock
    )
    return manager, table, clock


@pytest.mark.parametrize("end", ["reap", "release"])
def test_leased_blocks_stay_pinned_then_return_to_the_prefix_cache(end: str) -> None:
    manager, leases, clock = make_leased_pool()
    pool = manager.pool
    prompt = list(range(10))  # 2 full blocks + 1 partial
    table = prefill(manager, prompt)
    full, partial = table.block_ids[:2], table.block_ids[2]
    lease = leases.grant("req", table, ttl_s=30)

    # While leased the blocks are USED: memory pressure cannot evict them.
    assert (pool.num_used, pool.num_free, pool.num_cached) == (3, 5, 0)
    assert pool.allocate(6) is None
    manager.check_integrity()

    if end == "reap":
        assert leases.reap(now=129.0) == []
        clock.now = 130.0
        assert leases.reap() == [lease]
    else:
        assert leases.release(lease.handle_id)
    manager.check_integrity()
    assert (pool.num_used, pool.num_free, pool.num_cached) == (0, 6, 2)
    assert [pool.ref_count(b) for b in full] == [0, 0]
    assert all(pool.block_hash(b) is not None for b in full)  # CACHED, not FREE
    assert pool.block_hash(partial) is None  # the partial block had no hash: FREE

    # A retry of the same prompt hits both full blocks.
    hashes = hash_blocks(prompt, BLOCK_SIZE, model_fingerprint=FP)
    assert manager.match_prefix(hashes, (len(prompt) - 1) // BLOCK_SIZE) == full
    retry = prefill(manager, prompt)
    assert retry.block_ids[:2] == full
    manager.free(retry)
    manager.check_integrity()
    assert leases.stats().active == 0


def test_state_tells_an_expired_lease_from_an_unknown_or_released_one() -> None:
    table, _, clock = make_table()
    live = table.grant("live", "x", ttl_s=100)
    reaped = table.grant("reaped", "y", ttl_s=1)
    unreaped = table.grant("unreaped", "z", ttl_s=1)
    released = table.grant("released", "w", ttl_s=100)
    assert table.state(reaped.handle_id) is LeaseState.ACTIVE
    assert table.release(released.handle_id)
    clock.now = 101.0
    assert table.reap() == [reaped, unreaped]
    late = table.grant("late", "v", ttl_s=1, now=100.0)  # expired, not reaped
    assert table.state(live.handle_id) is LeaseState.ACTIVE
    assert table.state(reaped.handle_id) is LeaseState.EXPIRED
    assert table.state(late.handle_id) is LeaseState.EXPIRED
    assert table.release(late.handle_id), "an expired lease is still freed by release"
    assert table.state(late.handle_id) is LeaseState.EXPIRED, "...and stays known as expired"
    assert table.state(released.handle_id) is LeaseState.UNKNOWN
    assert table.state("no-such-handle") is LeaseState.UNKNOWN


def test_expired_handles_are_remembered_in_a_bounded_fifo() -> None:
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(Recorder(), clock=clock, remember_expired=2)
    leases = [table.grant(f"r{i}", "x", ttl_s=1 + i) for i in range(3)]
    clock.now = 110.0
    assert table.reap() == leases
    states = [table.state(lease.handle_id) for lease in leases]
    assert states == [LeaseState.UNKNOWN, LeaseState.EXPIRED, LeaseState.EXPIRED]
    with pytest.raises(ValueError, match="remember_expired"):
        LeaseTable(Recorder(), remember_expired=-1)
