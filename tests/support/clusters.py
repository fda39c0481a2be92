"""The clusters the end-to-end tests run against, started by `start_cluster` (the code of
`pagedserve up`: redis-server, router, prefill and decode worker processes, a gateway with
`http_port`).

One `Clusters` factory lives for the whole session (the `clusters` fixture of tests/conftest.py):

- `clusters.get(model_dir, **flags)`: the ONE running cluster of that configuration, shared by
  every test that asks for the same model and flags; started on first use, stopped at the end of
  the session. A test that uses it must leave it as it found it (no killed child, no held
  block, no flag changed).
- `clusters.private(model_dir, **flags)`: a fresh cluster for the caller alone (a `with` block),
  for a test that damages it (kills a child, stops Redis) or checks how it stops.

Every cluster is checked when it stops: each child process has exited.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedserve.launcher import start_cluster
from pagedserve.supervisor import Cluster

# `pagedserve up`'s arguments as the tests give them unless a flag overrides one: the tiny
# model's KV in 16 MiB, one worker of each role, its own redis-server.
UP_DEFAULTS: dict[str, object] = dict(
    host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None, block_size=16, dtype=None,
    kv_cache_memory="16MiB", start_timeout=120.0, log_dir=None,
)  # fmt: skip

# The router's `--max-n` of the shared tiny cluster: the sample tests need 6 samples of a prompt
# (tests/router/test_samples_e2e.py); the other tests on that cluster ask for one.
SAMPLES_MAX_N = 6

Flags = tuple[tuple[str, object], ...]


def up_args(model_dir: Path | str, **flags: object) -> argparse.Namespace:
    """The `pagedserve up` arguments of `model_dir`: `UP_DEFAULTS`, then `flags` (attribute
    names of `pagedserve up`'s parser, e.g. `max_n=6`, `metrics=True`)."""
    return argparse.Namespace(**(UP_DEFAULTS | {"model": str(model_dir)} | flags))


def stop_and_check(*clusters: Cluster, timeout_s: float = 15.0) -> None:
    """Stop each cluster (drain, then kill what lingers), then check that every child of each
    one has exited."""
    for cluster in clusters:
        cluster.stop(timeout_s=timeout_s)
    running = [c.name for cluster in clusters for c in cluster.children if c.proc.poll() is None]
    assert not running, f"children still running after stop: {running}"


class Clusters:
    """The session's clusters: shared ones by configuration, and private ones on request."""

    def __init__(self, log_root: Path) -> None:
        self._log_root = log_root
        self._shared: dict[tuple[str, Flags], Cluster] = {}
        self._started = 0

    def get(self, model_dir: Path | str, **flags: object) -> Cluster:
        """The shared running cluster of `model_dir` with `flags` (started on first use).
        `flags` values must be hashable: they are the key of the configuration."""
        key = (str(model_dir), tuple(sorted(flags.items())))
        if key not in self._shared:
            self._shared[key] = self._start(model_dir, flags)
        return self._shared[key]

    @contextmanager
    def private(
        self, model_dir: Path | str, *, stop_timeout_s: float = 15.0, **flags: object
    ) -> Iterator[Cluster]:
        """A cluster of the caller's own, stopped (and checked) when the block ends."""
        cluster = self._start(model_dir, flags)
        try:
            yield cluster
        finally:
            stop_and_check(cluster, timeout_s=stop_timeout_s)

    def close(self) -> None:
        """Stop every shared cluster (end of the session) and check each one."""
        shared, self._shared = list(self._shared.values()), {}
        stop_and_check(*shared)

    def _start(self, model_dir: Path | str, flags: dict[str, object]) -> Cluster:
        self._started += 1
        log_dir = self._log_root / f"cluster-{self._started}"
        log_dir.mkdir(parents=True)
        return start_cluster(up_args(model_dir, **flags), log_dir)
