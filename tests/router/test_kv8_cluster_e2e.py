"""The 8-bit KV cache through real processes (redis-server, router, prefill and decode workers
started as `pagedserve up` starts them, `--kv-cache-dtype int8`): greedy output equals an
in-process engine with the same 8-bit cache, on both routes (blocks prefilled by the prefill
worker and moved to the decode worker with their scales, and prompts prefilled on the decode
worker), so the transfer is exact; the pages that moved are 8-bit ones; no block stays held."""

from __future__ import annotations

import pytest
from support.oracle import make_prompts
from support.probes import generate_each

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.model.config import load_model_config
from pagedserve.model.runner import kv_cache_spec
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LENS = (5, 17, 33, 64)  # 5 and 17: prefilled on the decode worker; 33 and 64: handed off


@pytest.fixture(scope="module")
def cluster(make_tiny, clusters):
    model_dir = make_tiny("llama")
    flags = dict(kv_cache_dtype="int8", max_local_prefill_tokens=20, local_prefill_queue_tokens=0)
    with clusters.private(model_dir, metrics=True, **flags) as started:
        yield started, model_dir


def in_process(model_dir, prompts) -> list[list[int]]:
    config = DecodeEngineConfig(block_size=16, num_blocks=64, num_swap_blocks=0,
                                kv_cache_dtype="int8")  # fmt: skip
    engine = DecodeEngine.from_model_dir(str(model_dir), config)
    try:
        return [s.output_token_ids for s in engine.generate(prompts, GREEDY)]
    finally:
        engine.close()


def test_8bit_kv_through_the_cluster_equals_an_in_process_run(cluster):
    started, model_dir = cluster
    prompts = make_prompts(LENS, seed=11)
    want = in_process(model_dir, prompts)
    got, grew = generate_each(started, prompts, GREEDY)
    assert got == want
    moved = grew["pagedserve:kv_transfer_bytes_shm_total"]
    spec = kv_cache_spec(load_model_config(model_dir, kv_cache_dtype="int8"), 16)
    assert spec.quantized and spec.bytes_per_block < spec.codes_bytes * 1.1
    # every block of the two handed-off prompts (the partial last one of 33 too, which the
    # decode worker then appends to), at the 8-bit page size
    assert moved == (3 + 4) * spec.bytes_per_block
