"""Process supervision for `pagedserve up`: children started through an orphan guard, their
READY line awaited, stopped in order, and restarted as Kubernetes would (back-off, crash-loop
limit). What the children are (their command lines) is the launcher's (launcher.py).

Children are tied to the launcher's life (PR_SET_PDEATHSIG), so even a killed launcher leaves no
process behind. A restarted child keeps its argv, port and log (appended); a dead worker's KV
segments in /dev/shm are removed before it starts again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1

# NOTE: a shim the child runs before it becomes the real program: it asks for SIGTERM when its
# parent dies (PR_SET_PDEATHSIG, kept across exec), leaves if the parent is already gone, then
# execs. Not a `preexec_fn`: that makes subprocess fork() instead of vfork(), and a fork() of a
# process running gRPC's event engine can abort the child before exec ("epoll_wait error: Bad
# file descriptor"; grpc/grpc#43055), which a test process or a bench driver is.
_ORPHAN_GUARD = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    f"    ctypes.CDLL('libc.so.6', use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _guarded(argv: list[str]) -> list[str]:
    """`argv`, started through the orphan guard: it dies with this process."""
    return [sys.executable, "-c", _ORPHAN_GUARD, str(os.getpid()), *argv]


@dataclass(slots=True)
class Child:
    """One supervised process: what started it (to start it again) and where it serves."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""
    metrics_port: int | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    segments: list[str] = field(default_factory=list)  # /dev/shm KV pools it owns (prefill)

    def note_segments(self) -> None:
        """Remember the KV segments a worker created (a prefill worker's pool, and with
        tensor parallelism its other ranks' pools). NOTE: called when it says READY, before a
        decode worker has mapped any prefill worker's segment (which it must not remove)."""
        if self.name.startswith(("prefill", "decode")):
            self.segments = shm_segments(self.proc.pid)

    def pin_port(self) -> None:
        """A child started with `--port 0` restarts at the port it bound (its READY address)."""
        port_at = self.argv.index("--port") + 1
        self.argv[port_at] = self.address.rsplit(":", 1)[1]


@dataclass(slots=True)
class Cluster:
    children: list[Child] = field(default_factory=list)
    redis_url: str | None = None
    router_address: str = ""
    http_url: str = ""  # the gateway's, when `--http-port` started one

    def stop(self, timeout_s: float = 15.0) -> None:
        """Gateway and router first (they drain), then workers, then Redis; kill what
        lingers."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            if child.name in ("gateway", "router"):
                _wait(child.proc, timeout_s)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            _wait(child.proc, max(0.1, deadline - time.monotonic()))


class StartInterrupted(Exception):
    """A stop was requested (SIGTERM / SIGINT) before the cluster was ready."""


class StartFailed(RuntimeError):
    """A child did not become ready: `line` says which, how, why and where its log is (one
    line, what `pagedserve up` prints); str() adds the log's tail (for tests and callers)."""

    def __init__(
        self, child: str, how: str, reason: str, log_path: Path | None, tail: str = ""
    ) -> None:
        self.line = f"{child} did not start ({how})" + (f": {reason}" if reason else "")
        if log_path is not None:
            self.line += f"; log: {log_path}"
        super().__init__(f"{self.line}\n{tail}" if tail else self.line)


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise StartInterrupted("stopped during start-up")


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Child:
    """Start `argv` as child `name`, its stderr in `log_dir/name.log`, tied to this process's
    life (the orphan guard); call from the main thread (see `_popen`)."""
    log_path = log_dir / f"{name}.log"
    child = Child(name, _popen(argv, log_path, env, "w"), log_path, argv=argv, env=env)
    child.metrics_port = _metrics_port(argv)
    return child


def _popen(argv: list[str], log_path: Path, env: dict[str, str] | None, mode: str):
    """Start one child. NOTE: call from the main thread only: PR_SET_PDEATHSIG fires when the
    *thread* that forked the child exits, so a child forked by a short-lived thread would be
    stopped with it."""
    with open(log_path, mode) as log:
        return subprocess.Popen(
            _guarded(argv), stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )


def _metrics_port(argv: list[str]) -> int | None:
    return int(argv[argv.index("--metrics-port") + 1]) if "--metrics-port" in argv else None


def await_ready(child: Child, timeout_s: float, stop: threading.Event | None = None) -> None:
    """Read the child's stdout until `READY <id> <address>` (in a thread, to bound the wait);
    StartInterrupted as soon as `stop` is set."""
    result: list[str] = []
    stdout = child.proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: result.append(stdout.readline()))
    reader.daemon = True
    reader.start()
    deadline = time.monotonic() + timeout_s
    while reader.is_alive() and time.monotonic() < deadline:
        _check_stop(stop)
        reader.join(0.1)
    line = result[0] if result else ""
    if not line.startswith("READY"):
        tail = child.log_path.read_text()[-3000:]
        how, reason = failure_reason(child.proc, tail, timeout_s)
        raise StartFailed(child.name, how, reason, child.log_path, tail)
    child.address = line.split()[2]
    child.note_segments()


# NOTE: how a command's own refusal starts (cli.main): "pagedserve prefill: error: model: ..."
_OWN_ERROR = re.compile(r"^pagedserve [\w-]+: error: ")


def failure_reason(proc: subprocess.Popen, log_tail: str, timeout_s: float) -> tuple[str, str]:
    """How a child that printed no READY line failed (its exit, or still not ready after
    `timeout_s`) and why: its last log line (its own error, or the exception a traceback ends
    with), without the command's `pagedserve X: error:` prefix."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(2)  # NOTE: its stdout closed; it may not have exited quite yet
    rc = proc.poll()
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    last = _OWN_ERROR.sub("", lines[-1]) if lines else ""
    return (f"not ready after {timeout_s:g} s" if rc is None else describe_exit(rc)), last


def shm_segments(pid: int) -> list[str]:
    """The pagedserve KV segments (/dev/shm files) process `pid` maps: a prefill worker's pool,
    a tensor-parallel worker's ranks' pools, which a SIGKILL leaves behind for whoever restarts
    it to remove."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/dev/shm/" in line}
    return sorted(p for p in paths if Path(p).name.startswith("pagedserve-kv-"))


def remove_segments(child: Child) -> None:
    """Unlink the segments a dead child left (an exiting worker unlinks its own first)."""
    for path in child.segments:
        with contextlib.suppress(OSError):
            os.unlink(path)
    child.segments = []


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Kubernetes' `restartPolicy: Always` with its back-off: a child that exits is started
    again after `backoff_s`, doubled per restart still inside the window, at most
    `max_backoff_s`; more than `max_restarts` exits within `window_s` is a crash loop."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max-restarts: must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0 or self.backoff_s < 0:
            raise ValueError("restart-window / restart-backoff: must be > 0 / >= 0")


DEFAULT_POLICY = RestartPolicy()


class CrashLoop(Exception):
    """A child exited more often than the restart policy allows."""


class Supervisor:
    """Restarts the children of a running cluster on the same argv, port and log (appended).

    Call `poll()` from the main thread (see `_popen`); it raises CrashLoop. A restarted child
    is back when it prints READY again (a reader thread logs it); Redis restarts on its port,
    empty: the workers re-register and re-publish, the router routes by load meanwhile.
    """

    def __init__(self, cluster: Cluster, policy: RestartPolicy, out=sys.stderr) -> None:
        self.cluster = cluster
        self.policy = policy
        self.restarts: dict[str, list[float]] = {}  # name -> exit times inside the window
        self._due: dict[str, float] = {}  # name -> when to start it again (monotonic)
        self._out = out

    def poll(self) -> None:
        now = time.monotonic()
        for child in self.cluster.children:
            if child.name in self._due:
                if now >= self._due[child.name]:
                    self._restart(child)
            elif (rc := child.proc.poll()) is not None:
                self._exited(child, rc, now)

    def _exited(self, child: Child, rc: int, now: float) -> None:
        remove_segments(child)
        recent = [t for t in self.restarts.get(child.name, []) if now - t < self.policy.window_s]
        if len(recent) >= self.policy.max_restarts:
            raise CrashLoop(
                f"{child.name} is crash-looping: it exited {len(recent) + 1} times within "
                f"{self.policy.window_s:g} s (last: {describe_exit(rc)}); see {child.log_path}"
            )
        delay = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** len(recent))
        self.restarts[child.name] = [*recent, now]
        self._due[child.name] = now + delay
        self._say(f"{child.name} exited ({describe_exit(rc)}); restarting in {delay:g} s")

    def _restart(self, child: Child) -> None:
        del self._due[child.name]
        child.proc = _popen(child.argv, child.log_path, child.env, "a")
        self._say(f"{child.name} restarted (pid {child.proc.pid})")
        if child.name != "redis":  # NOTE: redis prints no READY line; its port is the same
            threading.Thread(target=self._await_back, args=(child, child.proc), daemon=True).start()

    def _await_back(self, child: Child, proc: subprocess.Popen) -> None:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.startswith("READY") and proc is child.proc:
            child.note_segments()
            self._say(f"{child.name} is back at {line.split()[2]}")

    def _say(self, message: str) -> None:
        print(f"pagedserve up: {message}", file=self._out, flush=True)


def describe_exit(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exit status {rc}"
