"""Fixtures of the decode worker tests: a real redis-server per module (tests/redis_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
