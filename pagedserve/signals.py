"""Stop on SIGTERM / SIGINT without deadlocking on a second signal.

A handler that calls `threading.Event.set()` directly can hang the process for good: `set` takes
the Event's lock (not reentrant), and Python runs a signal's handler on the main thread between
two bytecodes, possibly inside the previous handler's `set`. A second SIGTERM at that moment (the
parent-death signal and a kill, Kubernetes and a user, Ctrl-C twice) waits on a lock its own
thread holds. Found on a prefill worker left running after `pagedserve up` was killed: its main
thread stuck in three nested `Event.set` calls.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(stop: threading.Event) -> None:
    """Set `stop` on the first SIGTERM or SIGINT; later ones find it set and return at once.

    Call from the main thread (Python installs handlers only there)."""
    first = [True]

    def handle(signum: int, frame: object) -> None:
        # NOTE: the flag flips before `set` is entered, so a signal that interrupts `set` never
        # calls it again; one that interrupts before the flip calls `set` first, unlocked
        if first[0]:
            first[0] = False
            stop.set()

    for signum in STOP_SIGNALS:
        signal.signal(signum, handle)
