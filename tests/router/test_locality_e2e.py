"""A conversation's next turn through real processes (redis-server, router, one prefill and two
decode workers, started as `pagedserve up` starts them, short-prompt local prefill off): turn
2's prompt (turn 1's prompt and answer, then a new message) goes to the decode worker that
served turn 1, which computes only the part it does not hold (conditional disaggregation by
locality) and pulls no KV block; the tokens equal transformers'. One private cluster, about
10 s to start on 2 cores."""

from __future__ import annotations

import pytest
import redis
import torch
from support.oracle import hf_greedy, make_prompts
from support.probes import scrape, tokens_of
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
IMPORTED = "pagedserve:kv_import_num_imported_total"
PULLED = (
    "pagedserve:kv_import_blocks_pulled_shm_total",
    "pagedserve:kv_import_blocks_pulled_grpc_total",
)


@pytest.fixture(scope="module")
def cluster(make_tiny, clusters):
    model_dir = make_tiny("llama")
    with clusters.private(model_dir, decode=2, metrics=True, max_local_prefill_tokens=0) as up:
        assert up.redis_url is not None, "redis-server is needed (`make redis`)"
        yield up, model_dir


def metrics(up) -> dict[str, dict[str, float]]:
    """Each child's Prometheus samples, by child name (router, prefill-0, decode-0, ...)."""
    return {c.name: scrape(c.metrics_port) for c in up.children if c.metrics_port is not None}


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def held_by(up, worker_id: str) -> int:
    """How many block keys in Redis name `worker_id` (its prefix-index entries)."""
    client = redis.Redis.from_url(up.redis_url)
    try:
        return sum(client.hexists(key, worker_id) for key in client.scan_iter("ps:*:blk:*"))
    finally:
        client.close()


def test_the_next_turn_goes_to_the_decode_worker_holding_the_conversation(cluster):
    up, model_dir = cluster
    prompt, message = make_prompts((40, 10), seed=48)
    m0 = metrics(up)
    with Client(up.router_address) as client:
        turn_1 = list(client.generate(prompt, GREEDY, timeout=120))
    answer = tokens_of(turn_1)
    assert answer == hf_greedy(model_dir, torch.float32, tuple(prompt))[0][:24]
    m1 = metrics(up)
    (served,) = [n for n in m1 if n.startswith("decode") and delta(m1[n], m0[n], IMPORTED) == 1]
    # 40 + 23 tokens' KV: 3 full blocks, the third with generated tokens; the prefill worker
    # holds the prompt's 2
    assert wait_until(lambda: held_by(up, served) == 3, 10.0), "decode blocks never published"

    turn_2_prompt = prompt + answer + message
    with Client(up.router_address) as client:
        turn_2 = list(client.generate(turn_2_prompt, GREEDY, timeout=120))
    want = hf_greedy(model_dir, torch.float32, tuple(turn_2_prompt))[0][:24]
    assert tokens_of(turn_2) == want
    assert turn_2[-1].usage.cached_prompt_tokens == 48  # only the decode worker held these
    m2 = metrics(up)
    assert delta(m2["router"], m1["router"], "pagedserve:routes_prefill_here_locality_total") == 1
    assert delta(m2["router"], m1["router"], "pagedserve:routes_prefill_worker_total") == 0
    for name in (IMPORTED, *PULLED):
        assert delta(m2[served], m1[served], name) == 0, name
    computed = "pagedserve:prompt_tokens_computed_total"
    assert delta(m2["prefill-0"], m1["prefill-0"], computed) == 0
