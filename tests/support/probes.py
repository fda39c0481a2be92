"""What the end-to-end tests read from a running cluster (tests/support/clusters.py): blocks
held per worker, a child process by name, a service's Prometheus samples, a stream's tokens."""

from __future__ import annotations

import urllib.request

from pagedserve.client import Client
from pagedserve.supervisor import Child, Cluster
from support.waits import wait_until


def blocks_in_use(client: Client) -> dict[str, int]:
    """Device blocks neither free nor cached, per worker id (from GetClusterStatus)."""
    return {w.worker_id: w.load.kv_blocks_total - w.load.kv_blocks_free - w.load.kv_blocks_cached
            for w in client.status().workers}  # fmt: skip


def child(cluster: Cluster, prefix: str) -> Child:
    """The first child process whose name starts with `prefix` ("router", "decode", ...)."""
    return next(c for c in cluster.children if c.name.startswith(prefix))


def scrape(port: int | None) -> dict[str, float]:
    """Every sample of the /metrics page on `port`, by its name (with labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        name: float(value)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for name, _, value in [line.rpartition(" ")]
    }


def tokens_of(parts) -> list[int]:
    """The token ids of a stream's messages, in order."""
    return [t for p in parts for t in p.token_ids]


def generate_each(started: Cluster, prompts, params) -> tuple[list[list[int]], dict[str, float]]:
    """Every prompt through the router one after another, until no block is held anywhere:
    (their tokens, how much each of the decode worker's metrics grew meanwhile). The cluster
    needs `metrics=True`."""
    decode_port = child(started, "decode").metrics_port
    before = scrape(decode_port)
    with Client(started.router_address) as client:
        got = [tokens_of(client.generate(p, params, timeout=60)) for p in prompts]
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 10.0), (
            "condition not met in time"
        )
    after = scrape(decode_port)
    return got, {name: value - before.get(name, 0) for name, value in after.items()}
