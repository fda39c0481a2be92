"""SIGTERM / SIGINT while a service is still starting (before its READY line): `pagedserve up`
and a single worker process must exit cleanly in bounded time, leaving no child process and no
shared-memory segment behind.

The signal is sent once the process has installed its handler (its SIGTERM bit shows in
/proc/PID/status `SigCgt`), that is while it loads the model, the window a Ctrl-C during a slow
start hits; a process still importing Python modules dies by the default action, holding nothing.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from support.processes import alive, children_of
from support.waits import wait_until

EXIT_TIMEOUT_S = 60.0  # loose: a worker finishes loading its model before it stops
SHM_PREFIX = "pagedserve-kv-"


def catches_sigterm(pid: int) -> bool:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}


def leaked(before: set[str]) -> set[str]:
    """Segments created since `before` that no live process maps (another test's live worker
    may hold one of its own meanwhile)."""
    new = segments() - before
    for maps in pathlib.Path("/proc").glob("[0-9]*/maps"):
        if not new:
            break
        try:
            text = maps.read_text()
        except OSError:
            continue
        new = {name for name in new if name not in text}
    return new


def stdout_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_pagedserve_up_stopped_during_start_up_leaves_nothing(make_tiny, tmp_path, sig):
    before = segments()
    up = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "up", "--model", str(make_tiny("llama")),
         "--port", "0", "--kv-cache-memory", "4MiB", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # the moment: both workers are in their main (loading the model), no router yet
        def workers_loading() -> list[int]:
            pids = [p for p in children_of(up.pid) if " prefill " in cmdline(p) or
                    " decode " in cmdline(p)]  # fmt: skip
            return pids if len(pids) == 2 and all(map(catches_sigterm, pids)) else []

        assert wait_until(workers_loading, 60), "the workers never started"
        children = children_of(up.pid)
        assert not any(" router " in cmdline(p) for p in children), "too late: router started"
        up.send_signal(sig)
        started = time.monotonic()
        assert up.wait(timeout=EXIT_TIMEOUT_S) == 0, up.stderr.read() if up.stderr else ""
        exit_s = time.monotonic() - started
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    assert "READY router" not in stdout_of(up)
    assert wait_until(lambda: not any(alive(p) for p in children), 5), (
        "a child outlived pagedserve up"
    )
    assert not leaked(before)
    print(f"pagedserve up exited {exit_s:.1f} s after {sig.name}; {len(children)} children gone")


@pytest.mark.parametrize(
    ("role", "sig"),
    [("prefill", signal.SIGTERM), ("decode", signal.SIGINT)],
    ids=["prefill-SIGTERM", "decode-SIGINT"],
)
def test_worker_stopped_during_start_up_exits_cleanly(make_tiny, role, sig):
    before = segments()
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", role, "--model", str(make_tiny("llama")),
         "--port", "0", "--num-gpu-blocks-override", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: catches_sigterm(worker.pid), 60), f"{role} never reached its main"
        worker.send_signal(sig)
        started = time.monotonic()
        rc = worker.wait(timeout=EXIT_TIMEOUT_S)
        exit_s = time.monotonic() - started
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    assert rc == 0, worker.stderr.read()[-3000:] if worker.stderr else rc
    assert "READY" not in stdout_of(worker), "the signal came too late: the worker had started"
    assert not children_of(worker.pid)
    assert not leaked(before)
    print(f"{role} exited {exit_s:.1f} s after {sig.name}")
