"""Joining the cluster (pagedserve/cluster.py) against a real redis-server: the record and its
incarnation, the load the heartbeat carries, leaving, and a Redis that is down at start."""

from __future__ import annotations

import subprocess
import sys

from support.redis_server import RedisServer
from support.waits import wait_until

from pagedserve.cluster import join, model_key
from pagedserve.kvstore.worker_registry import Role, WorkerLoad, WorkerRegistry, connect

MODEL = "tiny"
TIMEOUT_S = 0.2
BOUND_S = 3.0  # a wait that must end well within this (a bound, not a speed check)


def reader(server: RedisServer) -> WorkerRegistry:
    return WorkerRegistry(connect(server.url, timeout_s=TIMEOUT_S), MODEL)


def test_joined_worker_is_alive_with_its_incarnation_and_its_heartbeat_load(
    redis_server: RedisServer,
) -> None:
    waiting = iter(range(1, 1_000_000))
    member = join(
        connect(redis_server.url, timeout_s=TIMEOUT_S), MODEL, "d0", "10.0.0.2:7002",
        Role.DECODE, lambda: WorkerLoad(num_requests_waiting=next(waiting)),
        compat="ab/16", incarnation="inc-1", heartbeat_interval_s=0.02,
    )  # fmt: skip
    try:
        assert member.registered
        registry = reader(redis_server)
        assert registry.live_incarnations(["d0"]) == {"d0": "inc-1"}
        assert wait_until(lambda: member.heartbeater.beats >= 2, BOUND_S), (
            "timed out waiting until two beats"
        )
        info = registry.get("d0")
        assert info is not None
        assert (info.address, info.role, info.compat) == ("10.0.0.2:7002", Role.DECODE, "ab/16")
        assert info.load.num_requests_waiting > 0
    finally:
        calls: list[str] = []
        member.leave(before_deregister=lambda: calls.append("before"))
    assert calls == ["before"]
    assert member.heartbeater.stop(timeout_s=0)  # already stopped
    assert reader(redis_server).live_incarnations(["d0"]) == {}


def test_join_draws_a_fresh_incarnation_per_process_start(redis_server: RedisServer) -> None:
    client = connect(redis_server.url, timeout_s=TIMEOUT_S)
    first = join(client, MODEL, "p0", "a:1", Role.PREFILL, WorkerLoad, compat="")
    first.leave()
    second = join(client, MODEL, "p0", "a:1", Role.PREFILL, WorkerLoad, compat="")
    try:
        assert first.registry.me is not None and second.registry.me is not None
        old, new = first.registry.me.incarnation, second.registry.me.incarnation
        assert old != new
        assert reader(redis_server).live_incarnations(["p0"]) == {"p0": new}
    finally:
        second.leave()


def test_worker_joins_when_redis_returns_after_an_outage_at_start(
    redis_server: RedisServer,
) -> None:
    redis_server.stop()
    recreated: list[bool] = []
    member = join(
        connect(redis_server.url, timeout_s=TIMEOUT_S), MODEL, "p0", "a:1", Role.PREFILL,
        WorkerLoad, compat="", incarnation="inc-1", heartbeat_interval_s=0.02,
        on_recreated=lambda: recreated.append(True),
    )  # fmt: skip
    try:
        assert not member.registered
        assert wait_until(lambda: member.heartbeater.failures >= 1, BOUND_S), (
            "timed out waiting until a failed beat"
        )
        redis_server.start()
        assert wait_until(lambda: recreated, BOUND_S), (
            "timed out waiting until the record is re-created"
        )
        assert reader(redis_server).live_incarnations(["p0"]) == {"p0": "inc-1"}
    finally:
        member.leave()


def test_leave_with_redis_down_is_best_effort(redis_server: RedisServer) -> None:
    member = join(
        connect(redis_server.url, timeout_s=TIMEOUT_S), MODEL, "p0", "a:1", Role.PREFILL,
        WorkerLoad, compat="",
    )  # fmt: skip
    redis_server.stop()
    member.leave()  # logs, never raises
    assert member.heartbeater.stop(timeout_s=0)  # already stopped


def test_model_key_is_the_served_name_else_the_model_folder() -> None:
    assert model_key("chat", "/models/llama/") == "chat"
    assert model_key(None, "/models/llama/") == "llama"
    assert model_key(None, "llama") == "llama"


def test_cluster_imports_neither_torch_nor_a_service() -> None:
    code = (
        "import sys, pagedserve.cluster\n"
        "services = ('pagedserve.router', 'pagedserve.prefill_worker', "
        "'pagedserve.decode_worker', 'pagedserve.model', 'torch')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(services))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
