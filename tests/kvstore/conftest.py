"""Fixtures of the kvstore tests: a real redis-server per test (see tests/redis_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()
