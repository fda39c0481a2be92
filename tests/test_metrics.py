from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from pagedserve.metrics import CounterSource, Gauge, RequestMetrics, register_state


@dataclass
class Stats:
    granted: int = 0
    expired: int = 0


def test_request_and_state_metrics_use_the_vllm_style_names():
    registry = CollectorRegistry()
    requests = RequestMetrics(registry)
    stats = Stats()
    register_state(
        [Gauge("kv_cache_usage_perc", "KV used.", lambda: 0.25)],
        [CounterSource("kv_leases_", lambda: stats)],
        registry,
    )
    requests.finished(reason="length", prompt=10, generated=5, ttft_s=0.1, e2e_s=0.5)
    stats.granted = 3
    text = generate_latest(registry).decode()
    assert 'pagedserve:request_success_total{finished_reason="length"} 1.0' in text
    assert "pagedserve:prompt_tokens_total 10.0" in text
    assert "pagedserve:generation_tokens_total 5.0" in text
    assert "pagedserve:time_per_output_token_seconds_count 1.0" in text
    assert "pagedserve:kv_cache_usage_perc 0.25" in text
    assert "pagedserve:kv_leases_granted_total 3.0" in text
