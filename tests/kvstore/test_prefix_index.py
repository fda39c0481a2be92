"""PrefixIndex: exact per-worker prefix lengths, first-miss stop, incarnations, TTLs, outages.

Behaviours shared by both implementations run once per implementation (``index_env``); the
Redis one talks to a real redis-server (tests/support/redis_server.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import redis
from support.redis_server import RedisServer

from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind
from pagedserve.kvstore.hashing import BlockHash, hash_blocks
from pagedserve.kvstore.prefix_index import (
    ALL_CLEARED,
    REMOVED,
    STORED,
    Entry,
    IndexUnavailable,
    LocalPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
    StaticLiveness,
    Tier,
)
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect, worker_key

BLOCK_SIZE = 4
FP = bytes(range(16))
MODEL = "tiny"
TIMEOUT_S = 0.2
BOUND_S = 2.0  # a failing call must raise well within this (a bound, not a speed check)


def chain(num_blocks: int, *, start: int = 0, salt: str = "") -> list[BlockHash]:
    tokens = list(range(start, start + num_blocks * BLOCK_SIZE))
    return hash_blocks(tokens, BLOCK_SIZE, model_fingerprint=FP, cache_salt=salt)


def stored(hashes: list[BlockHash], tier: Tier = Tier.DEV) -> list[BlockEvent]:
    return [BlockEvent(BlockEventKind.STORED, h, tier) for h in hashes]


def removed(hashes: list[BlockHash]) -> list[BlockEvent]:
    return [BlockEvent(BlockEventKind.REMOVED, h) for h in hashes]


@dataclass
class IndexEnv:
    """An index plus the knobs a test needs: liveness control and the raw stored entries."""

    index: PrefixIndex
    set_alive: Callable[[str, str], None]
    set_dead: Callable[[str], None]
    raw_entries: Callable[[BlockHash], dict[str, str]]  # stale ones included

    def publish(self, worker_id: str, events: list[BlockEvent], incarnation: str = "i1") -> None:
        self.index.publish(worker_id, events, incarnation=incarnation)


def make_redis_env(server: RedisServer, **kwargs: object) -> IndexEnv:
    client = connect(server.url, timeout_s=TIMEOUT_S)
    index = RedisPrefixIndex(client, MODEL, **kwargs)  # type: ignore[arg-type]
    check = server.client()

    def set_alive(worker_id: str, incarnation: str) -> None:
        registry = WorkerRegistry(client, MODEL, ttl_s=60)
        registry.register(worker_id, "127.0.0.1:1", Role.PREFILL, incarnation=incarnation)

    def set_dead(worker_id: str) -> None:
        check.delete(worker_key(f"ps:{MODEL}:", worker_id))

    def raw_entries(h: BlockHash) -> dict[str, str]:
        raw = check.hgetall(index.block_key(h))
        return {k.decode(): v.decode() for k, v in raw.items()}  # type: ignore[union-attr]

    return IndexEnv(index, set_alive, set_dead, raw_entries)


def make_local_env(**kwargs: object) -> IndexEnv:
    liveness = StaticLiveness()
    index = LocalPrefixIndex(liveness=liveness, **kwargs)  # type: ignore[arg-type]

    def raw_entries(h: BlockHash) -> dict[str, str]:
        (row,) = index._fetch([h])
        return {w: e.encode() for w, e in row.items() if e is not None}

    return IndexEnv(index, liveness.set_alive, liveness.set_dead, raw_entries)


@pytest.fixture(params=["redis", "local"])
def make_env(request: pytest.FixtureRequest) -> Callable[..., IndexEnv]:
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        return lambda **kwargs: make_redis_env(server, **kwargs)
    return make_local_env


@pytest.fixture
def env(make_env: Callable[..., IndexEnv]) -> IndexEnv:
    return make_env()


def spy_chunks(index: PrefixIndex, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every chunk ``lookup`` reads."""
    sizes: list[int] = []
    original = index._fetch

    def fetch(hashes):  # type: ignore[no-untyped-def]
        sizes.append(len(hashes))
        return original(hashes)

    monkeypatch.setattr(index, "_fetch", fetch)
    return sizes


# -- both implementations ------------------------------------------------------------------------


def test_lookup_returns_each_workers_longest_prefix(env: IndexEnv) -> None:
    hashes = chain(5)
    env.set_alive("w1", "i1")
    env.set_alive("w2", "i1")
    env.publish("w1", stored(hashes[:4]))
    env.publish("w2", stored(hashes[:2]))
    assert env.index.lookup(hashes) == {"w1": 4, "w2": 2}
    assert env.index.lookup(hashes[:1]) == {"w1": 1, "w2": 1}
    assert env.index.lookup(chain(5, start=1000)) == {}
    assert env.index.lookup([]) == {}


def test_lookup_stops_at_the_first_miss(env: IndexEnv) -> None:
    hashes = chain(6)
    env.set_alive("w1", "i1")
    env.publish("w1", stored(hashes[:2] + hashes[3:]))  # block 2 missing
    assert env.index.lookup(hashes) == {"w1": 2}


def test_a_later_block_never_extends_a_prefix_that_broke(env: IndexEnv) -> None:
    hashes = chain(4)
    env.set_alive("w1", "i1")
    env.set_alive("w2", "i1")
    env.publish("w1", stored([hashes[0], hashes[2], hashes[3]]))
    env.publish("w2", stored(hashes[:2]))
    assert env.index.lookup(hashes) == {"w1": 1, "w2": 2}


def test_lookup_reads_doubling_chunks_and_no_chunk_past_the_miss(
    make_env: Callable[..., IndexEnv], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env(first_chunk=2, max_chunk=8)
    hashes = chain(40)
    env.set_alive("w1", "i1")
    env.publish("w1", stored(hashes[:3]))
    sizes = spy_chunks(env.index, monkeypatch)
    assert env.index.lookup(hashes) == {"w1": 3}
    assert sizes == [2, 4]  # block 3 (in the second chunk) is the miss

    env.publish("w1", stored(hashes))
    sizes.clear()
    assert env.index.lookup(hashes) == {"w1": 40}
    assert sizes == [2, 4, 8, 8, 8, 8, 2]


def test_eviction_removes_the_workers_entry(env: IndexEnv) -> None:
    hashes = chain(3)
    env.set_alive("w1", "i1")
    env.set_alive("w2", "i1")
    env.publish("w1", stored(hashes))
    env.publish("w2", stored(hashes[:1]))
    env.publish("w1", removed(hashes[1:2]))
    assert env.index.lookup(hashes) == {"w1": 1, "w2": 1}
    assert env.raw_entries(hashes[1]) == {}
    env.publish("w1", removed(hashes[:1]))
    assert env.index.holders(hashes[0]) == {"w2": Tier.DEV}


def test_events_apply_in_order_within_one_publish(env: IndexEnv) -> None:
    a, b = chain(2)
    env.set_alive("w1", "i1")
    env.publish("w1", stored([a]) + removed([a]) + removed([b]) + stored([b]))
    assert env.index.holders(a) == {}
    assert env.index.holders(b) == {"w1": Tier.DEV}


def test_entries_of_a_dead_incarnation_are_ignored_and_cleaned(env: IndexEnv) -> None:
    hashes = chain(3)
    env.set_alive("w1", "old")
    env.set_alive("w2", "i1")
    env.publish("w1", stored(hashes), incarnation="old")
    env.publish("w2", stored(hashes[:1]))
    env.set_alive("w1", "new")  # w1 restarted: its old entries describe a cache that is gone
    env.set_dead("w2")
    assert env.index.lookup(hashes) == {}
    assert [env.raw_entries(h) for h in hashes] == [{}, {}, {}]
    assert env.index.stats.stale_entries_cleaned == 4

    env.publish("w1", stored(hashes[:2]), incarnation="new")
    assert env.index.lookup(hashes) == {"w1": 2}
    assert env.raw_entries(hashes[0]) == {"w1": "dev:new"}


def test_cleanup_never_deletes_a_fresher_entry(env: IndexEnv) -> None:
    (h,) = chain(1)
    env.set_alive("w1", "new")
    env.publish("w1", stored([h]), incarnation="new")
    # A lookup that read an old value just before this publish landed asks to forget it.
    assert env.index._forget([(h, "w1", Entry(Tier.DEV, "old"))]) == 0
    assert env.index.holders(h) == {"w1": Tier.DEV}


def test_cache_salt_isolates_tenants(env: IndexEnv) -> None:
    tenant_a, tenant_b = chain(3, salt="tenant-a"), chain(3, salt="tenant-b")
    assert not set(tenant_a) & set(tenant_b)
    env.set_alive("w1", "i1")
    env.publish("w1", stored(tenant_a))
    assert env.index.lookup(tenant_a) == {"w1": 3}
    assert env.index.lookup(tenant_b) == {}
    assert env.index.lookup(chain(3)) == {}


def test_tier_is_recorded_per_worker(env: IndexEnv) -> None:
    (h,) = chain(1)
    env.set_alive("w1", "i1")
    env.set_alive("w2", "i1")
    env.publish("w1", stored([h]))
    env.index.publish("w2", stored([h], Tier.HOST), incarnation="i1")
    assert env.index.holders(h) == {"w1": Tier.DEV, "w2": Tier.HOST}
    assert env.index.lookup([h]) == {"w1": 1, "w2": 1}


def test_a_stored_event_in_another_tier_moves_the_entry(env: IndexEnv) -> None:
    a, b, c = chain(3)
    env.set_alive("w1", "i1")
    env.publish("w1", stored([a, b, c]))
    env.publish("w1", stored([b], Tier.HOST) + stored([c], Tier.DISK))
    assert [env.index.holders(x) for x in (a, b, c)] == [
        {"w1": Tier.DEV}, {"w1": Tier.HOST}, {"w1": Tier.DISK}
    ]  # fmt: skip
    assert env.index.lookup([a, b, c]) == {"w1": 3}  # every tier counts: a copy, no recompute
    env.publish("w1", stored([b]) + removed([c]))
    assert env.index.holders(b) == {"w1": Tier.DEV}
    assert env.index.lookup([a, b, c]) == {"w1": 2}


def test_refresh_restores_each_hash_in_its_tier(env: IndexEnv) -> None:
    a, b, c = chain(3)
    env.set_alive("w1", "i1")
    env.index.refresh("w1", {a: Tier.DEV, b: Tier.HOST, c: Tier.DISK}, incarnation="i1")
    assert [env.index.holders(x) for x in (a, b, c)] == [
        {"w1": Tier.DEV}, {"w1": Tier.HOST}, {"w1": Tier.DISK}
    ]  # fmt: skip


def test_entry_values_of_every_tier_decode() -> None:
    for tier in Tier:
        assert Entry.decode(f"{tier.value}:abc") == Entry(tier, "abc")
    assert Entry.decode("gpu:abc") is None


def test_clear_removes_the_named_entries(env: IndexEnv) -> None:
    hashes = chain(3)
    env.set_alive("w1", "i1")
    env.set_alive("w2", "i1")
    env.publish("w1", stored(hashes))
    env.publish("w2", stored(hashes))
    env.index.clear("w1", hashes)
    assert env.index.lookup(hashes) == {"w2": 3}


def test_refresh_restores_lost_entries(env: IndexEnv) -> None:
    hashes = chain(2)
    env.set_alive("w1", "i1")
    env.index.refresh("w1", hashes, incarnation="i1")
    assert env.index.lookup(hashes) == {"w1": 2}


def test_bad_arguments_are_value_errors(env: IndexEnv) -> None:
    with pytest.raises(ValueError, match="block_hash"):
        env.publish("w1", stored([BlockHash(b"short")]))
    with pytest.raises(ValueError, match="worker_id"):
        env.publish("", stored(chain(1)))
    with pytest.raises(ValueError, match="incarnation"):
        env.publish("w1", stored(chain(1)), incarnation="a:b")


# -- Redis ---------------------------------------------------------------------------------------


@pytest.fixture
def redis_env(redis_server: RedisServer) -> IndexEnv:
    return make_redis_env(redis_server)


def test_redis_keys_follow_the_design_layout(redis_server: RedisServer) -> None:
    env = make_redis_env(redis_server, entry_ttl_s=60)
    hashes = chain(2)
    env.set_alive("w1", "i1")
    env.publish("w1", stored(hashes))
    check = redis_server.client()
    keys = sorted(k.decode() for k in check.keys("ps:tiny:blk:*"))  # type: ignore[union-attr]
    assert keys == sorted(f"ps:tiny:blk:{h.hex()}" for h in hashes)
    assert check.hgetall(f"ps:tiny:blk:{hashes[0].hex()}") == {b"w1": b"dev:i1"}
    assert 0 < check.pttl(f"ps:tiny:blk:{hashes[0].hex()}") <= 60_000  # type: ignore[operator]
    assert not check.exists("ps:tiny:events")  # stream is off unless asked for


def test_redis_publish_refreshes_the_key_ttl(redis_server: RedisServer) -> None:
    env = make_redis_env(redis_server, entry_ttl_s=60)
    (h,) = chain(1)
    env.set_alive("w1", "i1")
    env.set_alive("w2", "i1")
    env.publish("w1", stored([h]))
    check = redis_server.client()
    key = f"ps:tiny:blk:{h.hex()}"
    check.pexpire(key, 1000)
    env.publish("w2", stored([h]))
    assert check.pttl(key) > 50_000  # type: ignore[operator]
    check.pexpire(key, 1000)
    env.index.refresh("w1", [h], incarnation="i1")
    assert check.pttl(key) > 50_000  # type: ignore[operator]


def test_redis_expired_key_drops_out_of_lookup(
    redis_env: IndexEnv, redis_server: RedisServer
) -> None:
    hashes = chain(2)
    redis_env.set_alive("w1", "i1")
    redis_env.publish("w1", stored(hashes))
    redis_server.client().pexpire(f"ps:tiny:blk:{hashes[1].hex()}", 1)
    deadline = time.monotonic() + BOUND_S
    while redis_env.index.lookup(hashes) != {"w1": 1}:
        assert time.monotonic() < deadline, "key did not expire"
        time.sleep(0.005)


def test_redis_last_removal_deletes_the_key(redis_env: IndexEnv, redis_server: RedisServer) -> None:
    (h,) = chain(1)
    redis_env.set_alive("w1", "i1")
    redis_env.publish("w1", stored([h]))
    redis_env.publish("w1", removed([h]))
    assert redis_server.client().exists(f"ps:tiny:blk:{h.hex()}") == 0


def test_redis_events_stream_holds_vllm_shaped_batches(redis_server: RedisServer) -> None:
    env = make_redis_env(redis_server, events_maxlen=1000, block_size=BLOCK_SIZE)
    index = env.index
    assert isinstance(index, RedisPrefixIndex)
    a, b = chain(2)
    env.publish("w1", stored([a, b]) + removed([b]))
    index.refresh("w1", [b], incarnation="i1")  # refresh writes no event
    index.clear("w1", [a, b])
    batches = index.read_events()
    assert [(x.worker_id, x.incarnation) for x in batches] == [("w1", "i1"), ("w1", "")]
    assert batches[0].events == [
        {
            "type": STORED,
            "block_hashes": [a.hex(), b.hex()],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": BLOCK_SIZE,
            "lora_id": None,
            "medium": "dev",
        },
        {"type": REMOVED, "block_hashes": [b.hex()], "medium": "dev"},
    ]
    assert batches[1].events == [{"type": ALL_CLEARED}]
    assert index.read_events(after=batches[0].stream_id) == batches[1:]


def test_redis_events_stream_names_each_events_tier_as_its_medium(
    redis_server: RedisServer,
) -> None:
    env = make_redis_env(redis_server, events_maxlen=1000, block_size=BLOCK_SIZE)
    assert isinstance(env.index, RedisPrefixIndex)
    a, b, c = chain(3)
    env.publish("w1", stored([a]) + stored([b, c], Tier.HOST) + removed([c]))
    (batch,) = env.index.read_events()
    shape = [(e["type"], e["block_hashes"], e["medium"]) for e in batch.events]
    assert shape == [
        (STORED, [a.hex()], "dev"),
        (STORED, [b.hex(), c.hex()], "host"),
        (REMOVED, [c.hex()], "dev"),
    ]


def test_redis_events_stream_is_bounded(redis_server: RedisServer) -> None:
    env = make_redis_env(redis_server, events_maxlen=10)
    hashes = chain(300)
    for h in hashes:
        env.publish("w1", stored([h]))
    length = redis_server.client().xlen("ps:tiny:events")
    # NOTE: MAXLEN ~ trims whole stream nodes (100 entries by default), so it overshoots.
    assert 10 <= length <= 10 + 100  # type: ignore[operator]


def test_redis_killed_raises_index_unavailable_then_recovers(
    redis_env: IndexEnv, redis_server: RedisServer
) -> None:
    hashes = chain(2)
    redis_env.set_alive("w1", "i1")
    redis_env.publish("w1", stored(hashes))
    redis_server.stop()
    for call in (
        lambda: redis_env.index.lookup(hashes),
        lambda: redis_env.publish("w1", stored(hashes)),
        lambda: redis_env.index.clear("w1", hashes),
    ):
        start = time.monotonic()
        with pytest.raises(IndexUnavailable):
            call()
        assert time.monotonic() - start < BOUND_S
    assert redis_env.index.stats.lookup_errors == 1
    assert redis_env.index.stats.publish_errors == 1

    redis_server.start()  # same port, empty: the worker re-registers and republishes
    assert redis_env.index.lookup(hashes) == {}
    redis_env.set_alive("w1", "i1")
    redis_env.publish("w1", stored(hashes))
    assert redis_env.index.lookup(hashes) == {"w1": 2}


def test_redis_frozen_server_times_out_as_index_unavailable(
    redis_env: IndexEnv, redis_server: RedisServer
) -> None:
    hashes = chain(1)
    redis_env.set_alive("w1", "i1")
    redis_env.publish("w1", stored(hashes))
    redis_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(IndexUnavailable, match="Timeout"):
            redis_env.index.lookup(hashes)
        assert time.monotonic() - start < BOUND_S
    finally:
        redis_server.resume()
    assert redis_env.index.lookup(hashes) == {"w1": 1}


def test_redis_error_replies_are_index_unavailable(redis_server: RedisServer) -> None:
    env = make_redis_env(redis_server)
    (h,) = chain(1)
    check = redis_server.client()
    check.set(f"ps:tiny:blk:{h.hex()}", "not a hash")
    with pytest.raises(IndexUnavailable, match="WRONGTYPE"):
        env.index.lookup([h])
    with pytest.raises(redis.ResponseError):  # the raw client, for contrast
        check.hgetall(f"ps:tiny:blk:{h.hex()}")


# -- Local ---------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_local_entries_expire_after_their_ttl_unless_republished() -> None:
    clock = FakeClock()
    index = LocalPrefixIndex(entry_ttl_s=10, clock=clock)
    a, b = chain(2)
    index.publish("w1", stored([a, b]), incarnation="i1")
    clock.now = 9.0
    index.publish("w1", stored([a]), incarnation="i1")  # refreshes a's key only
    clock.now = 15.0
    assert index.lookup([a, b]) == {"w1": 1}
    assert len(index) == 1
    clock.now = 19.0
    assert index.lookup([a, b]) == {}
    assert len(index) == 0


def test_local_without_liveness_trusts_the_latest_incarnation() -> None:
    index = LocalPrefixIndex()
    a, b = chain(2)
    index.publish("w1", stored([a, b]), incarnation="old")
    assert index.lookup([a, b]) == {"w1": 2}
    index.publish("w1", stored([a]), incarnation="new")
    assert index.lookup([a, b]) == {"w1": 1}


def test_local_index_can_use_the_redis_registry_for_liveness(redis_server: RedisServer) -> None:
    registry = WorkerRegistry(connect(redis_server.url, timeout_s=TIMEOUT_S), MODEL)
    me = registry.register("w1", "127.0.0.1:1", Role.PREFILL)
    index = LocalPrefixIndex(liveness=registry)
    (h,) = chain(1)
    index.publish("w1", stored([h]), incarnation=me.incarnation)
    assert index.lookup([h]) == {"w1": 1}
    redis_server.stop()
    with pytest.raises(IndexUnavailable):
        index.lookup([h])


# -- imports -------------------------------------------------------------------------------------


def test_router_side_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import pagedserve.kvstore.prefix_index, pagedserve.kvstore.worker_registry\n"
        "import pagedserve.cluster, pagedserve.protoconv\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
