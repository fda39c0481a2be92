"""`WorkerHooks`: what a worker's server hands the worker at construction, alike for the prefill
and the decode worker (docs/architecture.md, "one shape per worker")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.core_share import CoreShare
from pagedserve.grpcutil import EngineLoop


@dataclass(frozen=True, slots=True)
class WorkerHooks:
    """Where the worker's loop runs, the host's cores it shares, and whom it tells when its
    loop dies. All optional: a bare worker (tests, the in-process bench) runs its loop on a
    thread of its own, with torch's threads, and tells nobody.

    `on_loop_death(death)` runs once, on the loop thread, after the worker is marked dead and
    before the requests in flight fail; it must not block."""

    engine_loop: EngineLoop | None = None  # None: a thread of the worker's own
    core_share: CoreShare | None = None  # the host's cores, lent between workers
    on_loop_death: Callable[[BaseException], None] | None = None


NO_HOOKS = WorkerHooks()
