"""Prometheus metrics, named `pagedserve:` + vLLM's suffixes where the meaning is the same.

Two kinds:
- **Request metrics** (histograms and counters updated as requests finish): `RequestMetrics`.
- **State metrics** read at scrape time from counters the components already keep (load
  reports, scheduler, lease and index stats): `StateCollector`, so no hot path pays for them.

What a scrape sees is `telemetry.export_registry`'s view of them: every `pagedserve:` series with a
`model_name` label, under pagedserve's names or (`--metrics-names vllm`) vLLM's.

docs/metrics.md lists every name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.telemetry import METRICS_PREFIX as PREFIX

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 60)
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class PhaseMetrics:
    """vLLM's per-request histograms, each observed by the service that sees the phase: queue
    and prefill time on the worker that queues and computes the prompt, decode time and the
    token counts where the tokens are made or streamed, inter-token latency on the router (as
    the client sees it). A service observes only what it sees; the others stay empty."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        self.queue = hist(
            "request_queue_time_seconds",
            "Time a request waited in this worker's queue.",
            _PHASE_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "First scheduled to first token, on the worker that prefilled.",
            _PHASE_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds", "First to last token of a request.", _PHASE_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between a request's successive tokens.",
            _LATENCY_BUCKETS,
        )
        self.prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.generation_tokens = hist("request_generation_tokens",
                                      "Generated tokens per request.", _TOKEN_BUCKETS)  # fmt: skip

    def tokens_arrived(self, gap_s: float, count: int) -> None:
        """`count` tokens arrived together `gap_s` after the request's previous ones: each is
        counted with the gap's share (a delta of several tokens is several intervals)."""
        for _ in range(count):
            self.itl.observe(gap_s / count)


class RequestMetrics:
    """What the router (and workers, for their own part) observe per request."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.tpot = hist("time_per_output_token_seconds", "Time per output token after the first.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.success = Counter(
            PREFIX + "request_success", "Finished requests.", ["finished_reason"], registry=registry
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", registry=registry)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            PREFIX + "cached_prompt_tokens",
            "Prompt tokens of finished requests served from a prefix cache (on whichever worker "
            "prefilled them).",
            registry=registry,
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused.", ["reason"], registry=registry
        )
        self.aborted = Counter(
            PREFIX + "requests_aborted", "Requests aborted.", ["cause"], registry=registry
        )
        self.prompt_and_cached = (0, 0)  # the two counters' totals, for ClusterStatus
        self.phases = PhaseMetrics(registry)

    def finished(
        self,
        *,
        reason: str,
        prompt: int,
        generated: int,
        ttft_s: float | None,
        e2e_s: float,
        cached: int = 0,
    ) -> None:
        self.success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_prompt_tokens.inc(cached)
        prompt_total, cached_total = self.prompt_and_cached
        self.prompt_and_cached = (prompt_total + prompt, cached_total + cached)
        self.generation_tokens.inc(generated)
        self.phases.prompt_tokens.observe(prompt)
        self.phases.generation_tokens.observe(generated)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.phases.decode.observe(e2e_s - ttft_s)
            if generated > 1:
                self.tpot.observe((e2e_s - ttft_s) / (generated - 1))


def prefix_cache_hit_rate(metrics: RequestMetrics) -> float:
    """Cached prompt tokens / prompt tokens over the requests finished so far (0 before any)."""
    prompt, cached = metrics.prompt_and_cached
    return cached / prompt if prompt else 0.0


@dataclass(frozen=True, slots=True)
class Gauge:
    name: str
    doc: str
    read: Callable[[], float]


@dataclass(frozen=True, slots=True)
class CounterSource:
    """Every int field of a stats dataclass becomes `pagedserve:{prefix}{field}_total`, except
    `gauge_fields`, which are levels (`pagedserve:{prefix}{field}`)."""

    prefix: str
    read: Callable[[], object]
    gauge_fields: tuple[str, ...] = ()


class StateCollector(Collector):
    """Gauges and counters computed from component state when Prometheus scrapes."""

    def __init__(self, gauges: list[Gauge], counters: list[CounterSource]) -> None:
        self.gauges = gauges
        self.counters = counters

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for gauge in self.gauges:
            yield GaugeMetricFamily(PREFIX + gauge.name, gauge.doc, value=float(gauge.read()))
        for source in self.counters:
            stats = source.read()
            if not is_dataclass(stats):
                continue
            for f in fields(stats):
                value = getattr(stats, f.name)
                if not isinstance(value, int) or isinstance(value, bool):
                    continue
                name, doc = PREFIX + source.prefix + f.name, f"{source.prefix}{f.name}"
                if f.name in source.gauge_fields:
                    yield GaugeMetricFamily(name, doc, value=value)
                else:
                    yield CounterMetricFamily(name, doc, value=value)


@dataclass(frozen=True, slots=True)
class PrefixCacheCounts:
    """vLLM's `prefix_cache_queries` / `prefix_cache_hits`: prompt tokens looked up / found."""

    queries: int
    hits: int


@dataclass(frozen=True, slots=True)
class PromptTokenCounts:
    """Prompt tokens a prefill worker computed / found in its prefix cache, since start."""

    computed: int
    cached: int


@dataclass(frozen=True, slots=True)
class PreemptionCounts:
    """vLLM's `num_preemptions`: sequences preempted (swap + recompute), since start."""

    num_preemptions: int


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """KV bytes imported, by transport."""

    bytes_shm: int
    bytes_grpc: int


def register_state(
    gauges: list[Gauge], counters: list[CounterSource], registry: CollectorRegistry = REGISTRY
) -> StateCollector:
    collector = StateCollector(gauges, counters)
    registry.register(collector)
    return collector
