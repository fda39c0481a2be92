"""A real `redis-server` on a free 127.0.0.1 port, for tests (docs/architecture.md).

No persistence (`--save "" --appendonly no`), its files in a temp dir, killed at teardown.
`stop()` kills it (a crash, as far as clients can tell); `start()` brings a fresh, empty server
back on the same port; `pause()` / `resume()` freeze it (SIGSTOP) to exercise socket timeouts.
The fixtures (`redis_server` per test, `module_redis` per module) are in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from support.ports import free_port

START_TIMEOUT_S = 10.0


class RedisServer:
    """One redis-server process; ``url`` stays the same across ``stop``/``start``."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (`make redis` installs it)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("redis-server already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        args += ["--daemonize", "no", "--loglevel", "warning", "--protected-mode", "no"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=(self.workdir / "redis.log").open("ab")
        )
        self._wait_for_ping()

    def stop(self) -> None:
        """SIGKILL the server and wait for it to go (idempotent)."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=5)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        """A plain client for the test's own checks (not the fail-fast one under test)."""
        return redis.Redis.from_url(self.url, socket_timeout=2.0)

    def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.2)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    log = (self.workdir / "redis.log").read_text(errors="replace")
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {log}")
                try:
                    if probe.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer PING in {START_TIMEOUT_S}s")
                time.sleep(0.01)
        finally:
            probe.close()


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A started redis-server, stopped on exit (the body of every redis fixture)."""
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
