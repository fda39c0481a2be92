"""Weight quantization through real processes (redis-server, router, prefill and decode
workers started as `pagedserve up` starts them, `--quantization int8`): greedy output equals
transformers on the dequantized weights, on both routes (KV handed off from the prefill
worker, and prefilled on the decode worker); no block stays held; and a router whose
`--quantization` differs from its workers' does not route to them (their block hashes
differ), instead of mixing K/V computed with other weights."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from support.oracle import hf_dequantized, hf_greedy_on, make_prompts
from support.probes import blocks_in_use, child, scrape, tokens_of
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.model.quant import WeightQuant
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
QUANT = WeightQuant("int8")


@pytest.fixture(scope="module")
def cluster(make_tiny, clusters):
    model_dir = make_tiny("llama")
    flags = dict(
        quantization="int8", quantization_group_size=32, max_local_prefill_tokens=20,
        local_prefill_queue_tokens=0,
    )  # fmt: skip
    with clusters.private(model_dir, metrics=True, **flags) as started:
        yield started, model_dir


def test_quantized_cluster_greedy_equals_transformers_on_dequantized_weights(cluster):
    started, model_dir = cluster
    lens = (5, 17, 33, 64)  # 5 and 17: prefilled on the decode worker; 33, 64: handed off
    prompts = make_prompts(lens, seed=7)
    model = hf_dequantized(model_dir, QUANT)
    before = scrape(child(started, "router").metrics_port)
    with Client(started.router_address) as client:
        for prompt in prompts:
            got = tokens_of(client.generate(prompt, GREEDY, timeout=60))
            assert got == hf_greedy_on(model, prompt, GREEDY.max_tokens), len(prompt)
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 10.0), (
            "condition not met in time"
        )
    after = scrape(child(started, "router").metrics_port)
    routed = {
        path: after[f"pagedserve:routes_{path}_total"]
        - before.get(f"pagedserve:routes_{path}_total", 0)
        for path in ("prefill_here", "prefill_worker")
    }
    assert routed == {"prefill_here": 2, "prefill_worker": 2}


def test_a_router_with_other_quantization_does_not_route_to_the_workers(cluster, tmp_path):
    started, model_dir = cluster
    # NOTE: it finds the workers where every router does, in their Redis registry
    router = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", "0", "--route-wait-timeout", "0.5",
         "--redis-url", started.redis_url],
        stdout=subprocess.PIPE, stderr=(tmp_path / "router.err").open("w"), text=True,
    )  # fmt: skip
    try:
        line = router.stdout.readline()
        assert line.startswith("READY router"), (tmp_path / "router.err").read_text()
        with Client(line.split()[2]) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate([5, 6, 7], GREEDY, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.terminate()
        router.wait(30)
    assert "differs" in (tmp_path / "router.err").read_text()
