"""The router routes only to registered workers whose block hashes agree with its own."""

from __future__ import annotations

import logging

from redis_server import RedisServer

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
    workers = WorkerSet([], [], registry, max_message_bytes=1 << 20, compat=MINE)
    try:
        with caplog.at_level(logging.ERROR, logger="pagedserve.router.routing"):
            workers.refresh(timeout_s=0.05)
            workers.refresh(timeout_s=0.05)
        assert {w.worker_id for w in workers.workers()} == {"prefill-same", "decode-old"}
        assert set(workers.incompatible) == {"prefill-bf16", "decode-bs32"}
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2, "logged once per worker, not on every refresh"
        assert any("prefill-bf16" in e and "--block-size" in e for e in errors)
    finally:
        workers.close()
