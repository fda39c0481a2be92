"""The decode worker tests share one redis-server per module (started worker processes use it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisServer, running_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server
