"""What the end-to-end tests read from a running cluster (tests/support/clusters.py): blocks
held per worker, a child process by name, a service's Prometheus samples, a stream's tokens."""

from __future__ import annotations

import re
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
    """Every sample of the /metrics page on `port`, by its name (with labels, less
    `model_name`: see `samples`)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return samples(text)


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, model_names: set[str] | None = None) -> dict[str, float]:
    """The samples of a Prometheus text page by name and labels, e.g. `a_total{x="1"}`. Every
    `pagedserve:` / `vllm:` sample must carry a `model_name` label (asserted); it is left out
    of the key and its values are added to `model_names` when given."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels_text = series.partition("{")
        labels = dict(_LABEL.findall(labels_text))
        if name.startswith(("pagedserve:", "vllm:")):
            assert "model_name" in labels, f"no model_name label: {line}"
            if model_names is not None:
                model_names.add(labels["model_name"])
        labels.pop("model_name", None)
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        values[f"{name}{{{inner}}}" if inner else name] = float(value)
    return values


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
