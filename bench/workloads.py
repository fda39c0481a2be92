"""Seeded workloads of token-id prompts with exact output lengths (docs/benchmarks/method.md).

Every request is run with `ignore_eos` and `max_tokens = output_len`, so each peer produces
exactly `output_len` useful tokens. Token ids are drawn from `[FIRST_ID, vocab)` so that no
special token (pad / bos / eos are the first ids of the tiny tokenizer) appears in a prompt.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

FIRST_ID = 3


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload. `arrival` is seconds after the run starts (0: at once)."""

    request_id: str
    prompt: list[int]
    output_len: int
    priority: int = 0
    arrival: float = 0.0


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def random_workload(n: int, vocab: int, seed: int) -> list[BenchRequest]:
    """Prompt 32-256 tokens, output 16-128 tokens, independent uniform draws."""
    rng = random.Random(seed)
    return [
        BenchRequest(f"r{seed}-{i}", _ids(rng, rng.randint(32, 256), vocab), rng.randint(16, 128))
        for i in range(n)
    ]


def shared_prefix_workload(
    n: int, vocab: int, seed: int, *, groups: int = 2, prefix_len: int = 512
) -> list[BenchRequest]:
    """`groups` system prompts of `prefix_len` tokens; each request adds a 16-64 token suffix."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(groups)]
    return [
        BenchRequest(
            f"s{seed}-{i}",
            prefixes[i % groups] + _ids(rng, rng.randint(16, 64), vocab),
            rng.randint(16, 64),
        )
        for i in range(n)
    ]


def prefix_repetition_workload(
    n: int, vocab: int, seed: int, *, num_prefixes: int = 4, prefix_len: int = 256
) -> list[BenchRequest]:
    """A few long prefixes repeated across requests, each with a 32-token unique suffix."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    return [
        BenchRequest(f"p{seed}-{i}", rng.choice(prefixes) + _ids(rng, 32, vocab), 32)
        for i in range(n)
    ]


def skewed_prefix_workload(
    n: int,
    vocab: int,
    seed: int,
    *,
    num_prefixes: int = 6,
    prefix_len: int = 256,
    shared_fraction: float = 0.5,
    zipf_s: float = 1.0,
) -> list[BenchRequest]:
    """A few hot system prompts and many one-off prompts, shuffled together.

    A share `shared_fraction` of the requests is system prompt `k` (`prefix_len` tokens, drawn
    with Zipf weight `1 / (k + 1) ** zipf_s`) + a 16-64 token user suffix; the rest are one-off
    prompts of 128-512 tokens that share nothing. Output 8 tokens: prefill dominates.
    """
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_prefixes)]
    out = []
    for i in range(n):
        if rng.random() < shared_fraction:
            prefix = rng.choices(prefixes, weights)[0]
            prompt = prefix + _ids(rng, rng.randint(16, 64), vocab)
        else:
            prompt = _ids(rng, rng.randint(128, 512), vocab)
        out.append(BenchRequest(f"z{seed}-{i}", prompt, 8))
    return out


def long_tail_workload(n: int, vocab: int, seed: int, *, long_fraction: float = 0.1):
    """Mostly short requests (prompt 32-64, output 16-32) and a tail of long ones (prompt
    512-768, output 128-192): lengths differ by more than 4x."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < long_fraction or i == 0:
            prompt, output = rng.randint(512, 768), rng.randint(128, 192)
        else:
            prompt, output = rng.randint(32, 64), rng.randint(16, 32)
        out.append(BenchRequest(f"l{seed}-{i}", _ids(rng, prompt, vocab), output))
    return out


WORKLOADS: dict[str, Callable[[int, int, int], list[BenchRequest]]] = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
    "prefix-repetition": prefix_repetition_workload,
    "skewed-prefix": skewed_prefix_workload,
    "long-tail": long_tail_workload,
}


def make_workload(name: str, n: int, vocab: int, seed: int) -> list[BenchRequest]:
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown {name!r} (choose from {sorted(WORKLOADS)})")
    return WORKLOADS[name](n, vocab, seed)


def with_arrivals(
    requests: list[BenchRequest], rate: float, seed: int, burstiness: float = 1.0
) -> list[BenchRequest]:
    """Gamma-distributed gaps (Poisson when burstiness = 1) at `rate` req/s; inf: all at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate/burstiness: must be > 0, got {rate}/{burstiness}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in requests:
        out.append(BenchRequest(r.request_id, r.prompt, r.output_len, r.priority, t))
        if rate != float("inf"):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def save_requests(requests: list[BenchRequest], path: Path) -> Path:
    path.write_text(json.dumps([asdict(r) for r in requests]))
    return path


def load_requests(path: str | Path) -> list[BenchRequest]:
    return [BenchRequest(**d) for d in json.loads(Path(path).read_text())]
