"""WorkerRegistry against a real redis-server: records, TTL expiry, heartbeats, deregistration."""

from __future__ import annotations

import threading
import time

import pytest
from support.redis_server import RedisServer
from support.waits import wait_until

from pagedserve.kvstore.worker_registry import (
    Heartbeater,
    RegistryUnavailable,
    Role,
    WorkerLoad,
    WorkerRegistry,
    compat_tag,
    connect,
)

MODEL = "tiny"
TIMEOUT_S = 0.2
BOUND_S = 3.0  # a wait that must end well within this (a bound, not a speed check)


def make_registry(server: RedisServer, ttl_s: float = 60.0) -> WorkerRegistry:
    return WorkerRegistry(connect(server.url, timeout_s=TIMEOUT_S), MODEL, ttl_s=ttl_s)


def test_registered_worker_is_listed_with_its_record(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server)
    load = WorkerLoad(num_requests_waiting=3, queued_prefill_tokens=700, kv_cache_usage=0.25)
    me = registry.register("p0", "10.0.0.1:7001", Role.PREFILL, load=load)
    assert len(me.incarnation) == 16
    assert registry.live_workers() == [me]
    assert registry.get("p0") == me
    assert registry.get("p1") is None
    assert registry.is_alive("p0", me.incarnation)
    assert not registry.is_alive("p0", "someone-else")
    assert not registry.is_alive("p1", me.incarnation)

    raw = redis_server.client().hgetall("ps:tiny:worker:p0")
    assert set(raw) == {
        b"address",
        b"role",
        b"incarnation",
        b"started_at",
        b"heartbeat_at",
        b"load",
        b"compat",
    }
    assert raw[b"role"] == b"prefill"
    assert redis_server.client().smembers("ps:tiny:workers") == {b"p0"}


def test_live_workers_filters_by_role_and_sorts_by_id(redis_server: RedisServer) -> None:
    for worker_id, role in [("d1", Role.DECODE), ("p1", Role.PREFILL), ("d0", Role.DECODE)]:
        make_registry(redis_server).register(worker_id, f"{worker_id}:1", role)
    reader = make_registry(redis_server)
    assert [w.worker_id for w in reader.live_workers()] == ["d0", "d1", "p1"]
    assert [w.worker_id for w in reader.live_workers(Role.DECODE)] == ["d0", "d1"]
    assert [w.worker_id for w in reader.live_workers(Role.ROUTER)] == []


def test_record_expires_without_heartbeat_and_heartbeat_recreates_it(
    redis_server: RedisServer,
) -> None:
    registry = make_registry(redis_server, ttl_s=0.2)
    me = registry.register("p0", "a:1", Role.PREFILL)
    assert redis_server.client().pttl("ps:tiny:worker:p0") > 0  # type: ignore[operator]
    assert wait_until(lambda: not registry.is_alive("p0", me.incarnation), BOUND_S), (
        "timed out waiting until the record expired"
    )
    assert registry.live_workers() == []
    assert redis_server.client().smembers("ps:tiny:workers") == set()  # lazily cleaned

    assert registry.heartbeat() is True  # re-created, same incarnation
    assert registry.is_alive("p0", me.incarnation)
    assert registry.heartbeat() is False


def test_heartbeat_renews_ttl_and_load(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server, ttl_s=60)
    registry.register("p0", "a:1", Role.PREFILL)
    check = redis_server.client()
    check.pexpire("ps:tiny:worker:p0", 1000)
    assert registry.heartbeat(WorkerLoad(num_requests_running=5)) is False
    assert check.pttl("ps:tiny:worker:p0") > 50_000  # type: ignore[operator]
    (info,) = make_registry(redis_server).live_workers()
    assert info.load == WorkerLoad(num_requests_running=5)


def test_deregister_removes_only_its_own_incarnation(redis_server: RedisServer) -> None:
    old = make_registry(redis_server)
    old_me = old.register("p0", "a:1", Role.PREFILL)
    new = make_registry(redis_server)
    new_me = new.register("p0", "a:2", Role.PREFILL)  # a restart under the same id
    assert old.deregister() is False
    assert new.live_workers() == [new_me]
    assert not new.is_alive("p0", old_me.incarnation)
    assert new.deregister() is True
    assert new.live_workers() == []
    assert redis_server.client().smembers("ps:tiny:workers") == set()


def test_heartbeat_before_register_is_a_bug(redis_server: RedisServer) -> None:
    with pytest.raises(RuntimeError, match="register"):
        make_registry(redis_server).heartbeat()


def test_redis_down_raises_registry_unavailable_quickly(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server)
    registry.register("p0", "a:1", Role.PREFILL)
    redis_server.stop()
    for call in (
        registry.heartbeat,
        registry.live_workers,
        registry.deregister,
        lambda: registry.is_alive("p0", "x"),
    ):
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            call()
        assert time.monotonic() - start < BOUND_S


def test_register_while_redis_is_down_keeps_the_identity(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server)
    redis_server.stop()
    with pytest.raises(RegistryUnavailable):
        registry.register("p0", "a:1", Role.PREFILL)
    redis_server.start()
    assert registry.heartbeat() is True
    assert registry.me is not None
    assert registry.is_alive("p0", registry.me.incarnation)


def test_heartbeater_reregisters_after_an_outage(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server)
    me = registry.register("p0", "a:1", Role.PREFILL)
    republished = threading.Event()
    beater = Heartbeater(registry, WorkerLoad, on_recreated=republished.set)
    beater.beat_once()
    redis_server.stop()
    beater.beat_once()
    assert (beater.beats, beater.failures) == (1, 1)
    redis_server.start()  # comes back empty
    beater.beat_once()
    assert beater.recreations == 1
    assert republished.is_set()
    assert registry.is_alive("p0", me.incarnation)


def test_heartbeater_thread_keeps_a_short_ttl_alive_and_stops_promptly(
    redis_server: RedisServer,
) -> None:
    registry = make_registry(redis_server, ttl_s=0.5)
    me = registry.register("p0", "a:1", Role.PREFILL)
    loads = iter(range(1_000_000))
    beater = Heartbeater(
        registry, lambda: WorkerLoad(num_requests_waiting=next(loads)), interval_s=0.02
    )
    beater.start()
    try:
        assert wait_until(lambda: beater.beats >= 40, BOUND_S), (
            "timed out waiting until 40 beats"
        )  # ~0.8 s: longer than the TTL
        assert registry.is_alive("p0", me.incarnation)
        info = registry.get("p0")
        assert info is not None and info.load.num_requests_waiting > 0
    finally:
        assert beater.stop(timeout_s=BOUND_S)


def test_heartbeater_stop_does_not_wait_for_the_interval(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server)
    registry.register("p0", "a:1", Role.PREFILL)
    beater = Heartbeater(registry, WorkerLoad, interval_s=3600)
    beater.start()
    start = time.monotonic()
    assert beater.stop(timeout_s=BOUND_S)
    assert time.monotonic() - start < 1.0


def test_load_json_ignores_unknown_keys() -> None:
    text = '{"num_requests_running": 2, "a_field_from_a_newer_writer": 1}'
    assert WorkerLoad.from_json(text) == WorkerLoad(num_requests_running=2)
    with pytest.raises(ValueError, match="load"):
        WorkerLoad.from_json("[1]")


def test_model_names_are_checked() -> None:
    with pytest.raises(ValueError, match="model"):
        WorkerRegistry(connect("redis://127.0.0.1:1"), "a b")


def test_compat_tag_is_kept_by_heartbeats_and_read_back(redis_server: RedisServer) -> None:
    registry = make_registry(redis_server)
    tag = compat_tag(bytes(range(16)), 16)
    assert tag == "000102030405060708090a0b0c0d0e0f/16"
    registry.register("d0", "10.0.0.2:7002", Role.DECODE, compat=tag)
    registry.heartbeat(WorkerLoad(num_requests_running=2))
    (info,) = registry.live_workers()
    assert info.compat == tag and info.load.num_requests_running == 2
    redis_server.client().hdel("ps:tiny:worker:d0", "compat")  # a worker that did not say
    assert registry.get("d0").compat == ""
