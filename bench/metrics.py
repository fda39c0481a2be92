"""Per-request timings and their summary (the `vllm bench serve` definitions).

    TTFT = first token - send        TPOT = (E2E - TTFT) / (output tokens - 1)
    ITL  = gaps between token-carrying messages (one per message, as a stream delivers them)
    E2E  = last token - send         goodput = requests/s meeting every SLO

Useful tokens of a request are `min(produced, output_len)`: over-generation earns nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """What one request did, times in seconds from the run's start."""

    request_id: str
    prompt_len: int
    output_len: int  # the exact length asked for
    priority: int = 0
    arrival: float = 0.0  # when it was due
    sent: float = 0.0  # when it was actually sent (or added to an engine)
    token_times: list[float] = field(default_factory=list)  # one per token-carrying message
    tokens: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.tokens) < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (len(self.tokens) - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def useful_tokens(self) -> int:
        return 0 if self.error else min(len(self.tokens), self.output_len)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "priority": self.priority,
            "arrival": self.arrival,
            "sent": self.sent,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "itl": self.itl,
            "num_tokens": len(self.tokens),
            "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.2


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p90": pick(0.9),
        "p99": pick(0.99),
    }


def _meets(r: RequestResult, slo: SLO) -> bool:
    ttft, tpot = r.ttft, r.tpot
    return (
        not r.error
        and ttft is not None
        and ttft <= slo.ttft_s
        and (tpot is None or tpot <= slo.tpot_s)
    )


def summarize(results: list[RequestResult], duration_s: float, slo: SLO | None = None) -> dict:
    """Throughput, goodput and the latency distributions of one run."""
    slo = slo or SLO()
    ok = [r for r in results if not r.error]
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(results),
        "num_errors": len(results) - len(ok),
        "duration_s": duration_s,
        "useful_tokens": sum(r.useful_tokens for r in results),
        "useful_tok_s": sum(r.useful_tokens for r in results) / duration_s,
        "req_s": len(ok) / duration_s,
        "goodput_req_s": sum(_meets(r, slo) for r in results) / duration_s,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl": percentiles([x for r in ok for x in r.itl]),
        "e2e": percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


def request_result(req: BenchRequest) -> RequestResult:
    """An empty result for `req` (no token yet), which an in-process peer fills as it runs."""
    return RequestResult(req.request_id, len(req.prompt), req.output_len, req.priority, req.arrival)


def peer_report(results: list[RequestResult], duration_s: float, **extra: Any) -> dict:
    """What an in-process peer prints for one run (bench/peers.py): the summary, every request's
    timings and tokens, and the peer's own `extra` fields."""
    summary = summarize(results, duration_s)
    summary["requests"] = [r.to_json() for r in results]
    summary["tokens"] = {r.request_id: r.tokens for r in results}
    return {**summary, **extra}
