"""The router routes only to registered workers whose block hashes agree with its own."""

from __future__ import annotations

import asyncio
import logging

from support.redis_server import RedisServer

from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, compat_tag, connect
from pagedserve.router.routing import WorkerSet

MODEL = "tiny"
MINE = compat_tag(b"\x01" * 16, 16)


def register(server: RedisServer, worker_id: str, role: Role, compat: str) -> None:
    registry = WorkerRegistry(connect(server.url, timeout_s=0.5), MODEL)
    registry.register(worker_id, f"127.0.0.1:{9 + len(worker_id)}", role, compat=compat)


def test_workers_of_another_fingerprint_or_block_size_are_not_routed_to(
    redis_server: RedisServer, caplog
) -> None:
    register(redis_server, "prefill-same", Role.PREFILL, MINE)
    register(redis_server, "prefill-bf16", Role.PREFILL, compat_tag(b"\x02" * 16, 16))
    register(redis_server, "decode-bs32", Role.DECODE, compat_tag(b"\x01" * 16, 32))
    register(redis_server, "decode-old", Role.DECODE, "")  # said nothing: trusted
    registry = WorkerRegistry(connect(redis_server.url, timeout_s=0.5), MODEL)

    async def scenario() -> WorkerSet:
        workers = WorkerSet([], [], registry, max_message_bytes=1 << 20, compat=MINE)
        try:
            await workers.refresh(timeout_s=0.05)
            await workers.refresh(timeout_s=0.05)
        finally:
            await workers.close()
        return workers

    with caplog.at_level(logging.ERROR, logger="pagedserve.router.routing"):
        workers = asyncio.run(scenario())
    assert {w.worker_id for w in workers.workers()} == {"prefill-same", "decode-old"}
    assert set(workers.incompatible) == {"prefill-bf16", "decode-bs32"}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, "logged once per worker, not on every refresh"
    assert any("prefill-bf16" in e and "--block-size" in e for e in errors)


def test_a_new_incarnation_does_not_cut_calls_already_on_the_channel(redis_server) -> None:
    """A worker restarted at the same address gets a new incarnation in the registry; the router
    replaces its entry, but calls that already run on the old channel (reconnected to the new
    process) go on: a close at once would cancel them and hang their clients."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from support.aio_servers import serving

    from pagedserve.grpcutil import build_server

    with serving(build_server([], ["test.Service"]), ready=False) as handle:
        address = f"127.0.0.1:{handle.port}"
        owner = WorkerRegistry(connect(redis_server.url, timeout_s=0.5), MODEL)
        owner.register("decode-r", address, Role.DECODE, incarnation="first")
        registry = WorkerRegistry(connect(redis_server.url, timeout_s=0.5), MODEL)

        async def scenario() -> list[int]:
            workers = WorkerSet([], [], registry, max_message_bytes=1 << 20)
            await workers.refresh(timeout_s=1.0)
            (old,) = workers.workers()
            watch = health_pb2_grpc.HealthStub(old.channel).Watch(
                health_pb2.HealthCheckRequest(service="test.Service"), timeout=30
            )
            seen = [(await watch.read()).status]
            owner.register("decode-r", address, Role.DECODE, incarnation="second")
            await workers.refresh(timeout_s=1.0)
            (new,) = workers.workers()
            assert new is not old and new.incarnation == "second" and new.restarts == 1
            asyncio.run_coroutine_threadsafe(handle.set_ready(True), handle.loop).result(5)
            seen.append((await watch.read()).status)  # the old channel's call still runs
            watch.cancel()
            await workers.close()
            return seen

        statuses = asyncio.run(scenario())
    assert statuses == [
        health_pb2.HealthCheckResponse.NOT_SERVING,
        health_pb2.HealthCheckResponse.SERVING,
    ]


def test_a_worker_whose_record_is_gone_leaves_the_set_but_a_static_one_stays(redis_server):
    owner = WorkerRegistry(connect(redis_server.url, timeout_s=0.5), MODEL)
    owner.register("decode-gone", "127.0.0.1:9", Role.DECODE)
    static = WorkerRegistry(connect(redis_server.url, timeout_s=0.5), MODEL)
    static.register("decode-static", "127.0.0.1:10", Role.DECODE)
    registry = WorkerRegistry(connect(redis_server.url, timeout_s=0.5), MODEL)

    async def scenario() -> tuple[set[str], set[str]]:
        workers = WorkerSet([], ["127.0.0.1:10"], registry, max_message_bytes=1 << 20)
        try:
            await workers.refresh(timeout_s=0.05)
            before = {w.worker_id for w in workers.workers()}
            owner.deregister()
            static.deregister()
            await workers.refresh(timeout_s=0.05)
            return before, {w.worker_id for w in workers.workers()}
        finally:
            await workers.close()

    before, after = asyncio.run(scenario())
    assert before == {"decode-gone", "decode-static"}
    assert after == {"decode-static"}  # listed by --decode: it may come back at its address
