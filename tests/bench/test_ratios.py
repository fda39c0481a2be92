"""S1's ratios: a peer whose run failed requests or whose tokens failed the gate gets none."""

from __future__ import annotations

from pagedserve.bench.driver import ScenarioResult
from pagedserve.bench.scenarios import _s1_ratios


def run(tok_s: float, errors: int = 0) -> dict:
    return {"useful_tok_s": tok_s, "num_errors": errors}


def metrics(res: ScenarioResult) -> set[str]:
    return {r.metric for r in res.ratios}


def test_every_ratio_when_every_peer_ran_clean():
    res = ScenarioResult("S1", gate={"passed": True})
    res.runs["hf-cb-gate"] = {"passed": True, "mismatches": []}
    _s1_ratios(res, {"engine": [run(100)], "cluster": [run(90)], "hf-cb": [run(50)]})
    assert metrics(res) == {"useful tok/s: engine / hf-cb", "useful tok/s: cluster / engine"}
    assert res.valid and not res.notes


def test_a_peer_that_failed_its_gate_or_requests_gets_no_ratio():
    res = ScenarioResult("S1", gate={"passed": True})
    res.runs["hf-cb-gate"] = {"passed": False, "mismatches": [{"request_id": "r0"}]}
    outs = {
        "engine": [run(100), run(100)],
        "cluster": [run(90), run(80, errors=3)],
        "hf-cb": [run(1e-12), run(1e-12)],  # made no tokens: the ratio would be absurd
        "hf-static": [run(20), run(20)],
    }
    _s1_ratios(res, outs)
    assert metrics(res) == {"useful tok/s: engine / hf-static"}
    assert not res.valid  # our own cluster failed requests: the run is invalid
    assert any("cluster: no ratio" in n and "[0, 3]" in n for n in res.notes)
    assert any("hf-cb: no ratio" in n for n in res.notes)


def test_the_engine_vllm_goal_is_the_models():
    outs = {"engine": [run(100)], "cluster": [run(90)], "vllm-cpu": [run(80)]}
    goals = {}
    for tiny in (True, False):
        res = ScenarioResult("S1", gate={"passed": True})
        res.runs["vllm-cpu-gate"] = {"passed": True, "mismatches": []}
        _s1_ratios(res, outs, tiny=tiny)
        (ratio,) = [r for r in res.ratios if r.metric == "useful tok/s: engine / vllm-cpu"]
        goals[tiny] = (ratio.goal, ratio.target)
    assert goals == {True: (">= 1.0", 1.0), False: (">= 1.3", 1.3)}


def test_the_default_cluster_against_full_disaggregation():
    res = ScenarioResult("S1", gate={"passed": True})
    res.runs["cluster-remote-gate"] = {"passed": True, "mismatches": []}
    outs = {
        "engine": [run(100)],
        "cluster": [run(90) | {"ttft": {"median": 3.0}}],
        "cluster-remote": [run(80) | {"ttft": {"median": 6.0}}],
    }
    _s1_ratios(res, outs)
    ratios = {r.metric: r.values for r in res.ratios}
    assert ratios["useful tok/s: cluster / cluster-remote"] == [90 / 80]
    assert ratios["median TTFT: cluster / cluster-remote"] == [0.5]
    res.runs["cluster-remote-gate"] = {"passed": False, "mismatches": [0]}
    res.ratios = []
    _s1_ratios(res, outs)
    assert not [r for r in res.ratios if "cluster-remote" in r.metric]


def test_the_per_token_stream_is_reported_beside_the_offline_client():
    res = ScenarioResult("S1", gate={"passed": True})
    outs = {"engine": [run(100)], "cluster": [run(95)], "cluster-streamed": [run(50)]}
    _s1_ratios(res, outs)
    ratios = {r.metric: (r.values, r.goal) for r in res.ratios}
    assert ratios["useful tok/s: cluster / engine"] == ([0.95], ">= 0.9")
    assert ratios["useful tok/s: cluster-streamed / engine"] == ([0.5], "")
    outs["cluster-streamed"] = [run(50, errors=2)]
    res = ScenarioResult("S1", gate={"passed": True})
    _s1_ratios(res, outs)
    assert not res.valid  # the same cluster failed requests when streamed per token
