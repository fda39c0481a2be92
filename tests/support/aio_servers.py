"""Asyncio gRPC servers (`pagedserve.grpcutil.build_server`) inside the test process, each on an
event loop thread (`LoopThread`): a test that holds one server's loop does not hold the others."""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from contextlib import contextmanager

from pagedserve.grpcutil import LoopThread, ServerHandle


async def _start(handle: ServerHandle, ready: bool) -> ServerHandle:
    await handle.server.start()
    if ready:
        await handle.set_ready(True)
    return handle


@contextmanager
def serving(build: Awaitable[ServerHandle], *, ready: bool = True) -> Iterator[ServerHandle]:
    """Build (`build`: the coroutine of `build_server` or a wrapper), start and, with `ready`,
    mark ready a server on a loop thread of its own; stop it and the loop on exit."""
    loop = LoopThread("test-server")

    async def build_and_start() -> ServerHandle:
        return await _start(await build, ready)

    handle = loop.run(build_and_start())
    try:
        yield handle
    finally:
        loop.run(handle.server.stop(None))
        loop.close()
