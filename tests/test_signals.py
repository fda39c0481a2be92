"""`stop_on_signals`: a second SIGTERM arriving while the first one's handler is inside
`Event.set` (which holds the Event's non-reentrant lock) must not deadlock the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

# NOTE: the Event below receives the second signal while its lock is held, every time: the
# window a real double SIGTERM hits by chance (found: a prefill worker hung for good this way)
PROGRAM = """
import os, signal, threading
from pagedserve.signals import stop_on_signals

class SignalledInsideSet(threading.Event):
    def set(self):
        with self._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):
                pass  # Python runs the pending handler here, with the lock held
            self._flag = True
            self._cond.notify_all()

stop = SignalledInsideSet()
{install}
os.kill(os.getpid(), signal.SIGTERM)
assert stop.wait(5)
print("stopped")
"""


def run(install: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM.format(install=install)],
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip


def test_a_second_signal_inside_set_does_not_deadlock():
    done = run("stop_on_signals(stop)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"


def test_the_naive_handler_deadlocks_so_the_test_above_can_fail():
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", PROGRAM.format(
                install="signal.signal(signal.SIGTERM, lambda *_: stop.set())")],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
