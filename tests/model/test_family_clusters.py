"""Every model family through real processes (`pagedserve up`: redis-server, router, prefill and
decode workers): 16 concurrent greedy streams of mixed lengths equal transformers' output token
for token. The short prompts are computed by the decode worker itself (prefill here), the longer
ones by the prefill worker and handed off; the KV budget holds a fraction of the streams, so the
decode worker preempts by swap. After the run no block is held anywhere.

One cluster per family, each started privately and stopped at the end of its test (the suite's
time: ~5 s per family). `llama-ngram` runs Llama with speculative decoding (n-gram lookup, up to
4 tokens, for batches of up to 16): the same tokens, some proposals accepted. `llama-draft`
runs it with a draft model, the target's own checkpoint: nearly every proposal accepted."""

from __future__ import annotations

import threading

import pytest
import torch
from support.oracle import hf_greedy, make_prompts
from support.probes import blocks_in_use, child, scrape, tokens_of
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.model.config import load_model_config
from pagedserve.model.runner import kv_cache_spec
from pagedserve.sampling_params import SamplingParams

# NOTE: <= LOCAL_MAX tokens are prefilled on the decode worker; the rest are handed off. 70 and
# 150 pass the sliding window of the families that have one (tiny_model.py's windows are <= 64).
LENS = (1, 3, 7, 12, 16, 20, 21, 25, 33, 40, 47, 64, 70, 90, 120, 150)
LOCAL_MAX = 20
KV_BLOCKS = 20  # per worker: under a third of what the 16 streams hold at their longest
DRAFT_KV_BLOCKS = 16  # with a draft model (below); the longest sequence needs 12 blocks
DRAFT_GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

# family -> the tiny checkpoint's `make_tiny_model` arguments
FAMILIES: dict[str, dict[str, object]] = {
    "mistral": {"sliding_window": 48},
    "qwen2": {},
    "qwen3": {"sliding_window": 48},
    "olmo2": {},
    "granite": {},
    "phi3": {"sliding_window": 48},  # and partial rotary (tiny_model.py)
    "gemma2": {},  # a window of 12 on layer 0, soft caps
    "gemma3": {},  # a window of 12 on layer 0, two ropes
    "mixtral": {"sliding_window": 48},
    "qwen2_moe": {},  # a gated shared expert
    "qwen3_moe": {},  # a dense last layer
    "llama-ngram": {},
    "llama-draft": {},
}
# family -> `pagedserve up` flags beyond the test's own
UP_FLAGS: dict[str, dict[str, object]] = {
    "llama-ngram": dict(speculative_method="ngram", num_speculative_tokens=4,
                        speculative_ngram_min=1, speculative_ngram_max=4, speculative_max_batch=16),
    # NOTE: the draft is the target's own checkpoint (its path is filled in by the test)
    "llama-draft": dict(speculative_method="draft", num_speculative_tokens=4,
                        speculative_max_batch=16),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_cluster_serves_the_family_as_transformers_under_swap(family, make_tiny, clusters):
    model_dir = make_tiny(family.partition("-")[0], **FAMILIES[family])
    spec = kv_cache_spec(load_model_config(model_dir), BLOCK_SIZE)
    flags = dict(
        metrics=True, max_local_prefill_tokens=LOCAL_MAX, local_prefill_queue_tokens=0,
        kv_cache_memory=str(KV_BLOCKS * spec.bytes_per_block), **UP_FLAGS.get(family, {}),
    )  # fmt: skip
    params = GREEDY
    if flags.get("speculative_method") == "draft":
        flags["speculative_model"] = str(model_dir)
        # NOTE: the draft's KV shares each block: twice the bytes per block. Its sequences
        # accept every proposal and finish in a fifth of the steps, so they overlap less: 20
        # blocks and 24 tokens gave 0-3 swap preemptions a run (one quiet run 0), 16 or 13
        # blocks 1-6; 16 blocks and 32 tokens keep the pressure
        flags["kv_cache_memory"] = str(2 * DRAFT_KV_BLOCKS * spec.bytes_per_block)
        params = DRAFT_GREEDY
    prompts = make_prompts(LENS, seed=31)
    with clusters.private(model_dir, **flags) as started:
        port = child(started, "decode").metrics_port
        before = scrape(port)
        got = _generate_concurrently(started.router_address, prompts, params)
        with Client(started.router_address) as client:
            assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 10.0)
        grew = {k: v - before.get(k, 0.0) for k, v in scrape(port).items()}
    for prompt, tokens in zip(prompts, got, strict=True):
        want = hf_greedy(model_dir, torch.float32, tuple(prompt))[0][: params.max_tokens]
        assert tokens == want, f"{family}: the prompt of {len(prompt)} tokens"
    swaps = grew["pagedserve:decode_num_preemptions_swap_total"]
    print(f"{family}: {swaps:.0f} swap preemptions")
    assert swaps > 0, "no swap preemption"
    assert grew["pagedserve:kv_transfer_bytes_shm_total"] > 0, "nothing was handed off"
    if "speculative_method" in flags:
        accepted = grew["pagedserve:spec_decode_num_accepted_tokens_total"]
        drafted = grew["pagedserve:spec_decode_num_draft_tokens_total"]
        print(f"{family}: {accepted:.0f} of {drafted:.0f} proposed tokens accepted")
        if flags["speculative_method"] == "draft":
            assert accepted > 0.9 * drafted  # NOTE: swaps reset the draft's KV: still accepted
        else:
            assert 0 < accepted < drafted


def _generate_concurrently(
    address: str, prompts: list[list[int]], params: SamplingParams
) -> list[list[int] | None]:
    results: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        with Client(address) as client:
            results[i] = tokens_of(client.generate(prompts[i], params, timeout=120))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results
