from __future__ import annotations

from dataclasses import dataclass

import pytest
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


def test_the_export_labels_every_series_with_the_model_and_renames_for_vllm():
    from support.probes import samples

    from pagedserve.telemetry import export_registry

    registry = CollectorRegistry()
    RequestMetrics(registry).finished(reason="stop", prompt=4, generated=3, ttft_s=0.1, e2e_s=0.4)
    ours, theirs = (
        generate_latest(export_registry("m", naming, registry)).decode()
        for naming in ("pagedserve", "vllm")
    )
    names: set[str] = set()
    mine = samples(ours, names)
    assert names == {"m"}
    assert mine['pagedserve:request_success_total{finished_reason="stop"}'] == 1.0
    assert mine["pagedserve:request_prompt_tokens_sum"] == 4.0
    assert mine["pagedserve:request_decode_time_seconds_sum"] == pytest.approx(0.3)
    vllm = samples(theirs, names)
    assert vllm['vllm:request_success_total{finished_reason="stop"}'] == 1.0
    # the per-request TPOT under vLLM's name for it; nothing left under ours
    assert vllm["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(0.15)
    assert not [k for k in vllm if k.startswith("pagedserve:")]
    assert 'model_name="m"' in theirs and names == {"m"}


def test_an_unknown_naming_is_refused():
    from pagedserve.telemetry import export_registry

    with pytest.raises(ValueError, match="--metrics-names: 'tgi'"):
        export_registry("m", "tgi")
