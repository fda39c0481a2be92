"""The one bounded wait of the tests: poll a condition until it holds or time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.02
) -> bool:
    """Poll `predicate` until it is true or `timeout_s` passes; its last value, as a bool.

    A bound, not a speed check: callers assert the result (`assert wait_until(...), what`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
