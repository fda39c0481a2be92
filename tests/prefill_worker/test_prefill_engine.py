"""PrefillEngine on the tiny model: first tokens equal transformers', blocks are leased in
shared memory, and every lease ends (release or expiry) with its blocks in the prefix cache."""

from __future__ import annotations

import os
import time

import pytest
import torch
from oracle import hf_greedy, make_prompts

from pagedserve.errors import InvalidArgument
from pagedserve.model.engine import Engine, EngineConfig
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture
def engine(tiny_llama):
    eng = PrefillEngine.from_model_dir(
        str(tiny_llama),
        PrefillEngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=128),
    )
    eng.start()
    yield eng
    eng.close()
    eng.pool.check_integrity()


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_first_tokens_match_transformers_and_kv_is_leased_in_shm(engine, tiny_llama):
    prompts = make_prompts((1, 16, 40, 130, 7), seed=11)
    futures = [engine.submit(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    results = [f.result(timeout=60) for f in futures]
    for prompt, result in zip(prompts, results, strict=True):
        assert (
            result.seq.output_token_ids
            == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0][:1]
        )
        assert result.lease is not None
        assert len(result.lease.resource.block_ids) == -(-len(prompt) // 16)
        assert result.lease_expires_unix_ms > time.time() * 1000
    assert engine.pool.num_used == sum(-(-len(p) // 16) for p in prompts)
    assert os.path.exists(f"/dev/shm/{engine.shm_pool.segment_name}")

    # the leased pages hold the same K/V a plain engine computes for the prompt
    reference = Engine.from_model_dir(str(tiny_llama), EngineConfig(block_size=16, num_blocks=64))
    prompt, result = prompts[3], results[3]
    seq = reference.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    reference.step()
    for i, (mine, theirs) in enumerate(
        zip(result.lease.resource.block_ids, seq.block_table.block_ids, strict=True)
    ):
        tokens = min(16, len(prompt) - i * 16)
        got = engine.runner.kv_cache.tensor[mine][:, :, :tokens]
        want = reference.runner.kv_cache.tensor[theirs][:, :, :tokens]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    reference.abort(seq.request_id)

    for result in results:
        assert engine.release(result.lease.handle_id)
        assert not engine.release(result.lease.handle_id), "release is idempotent"
    assert engine.pool.num_used == 0
    assert engine.pool.num_cached == sum(len(p) // 16 for p in prompts)


def test_expired_lease_is_reaped_into_the_prefix_cache_and_cannot_be_renewed(engine):
    (prompt,) = make_prompts((40,), seed=12)
    result = engine.submit("short", prompt, GREEDY, lease_seconds=0.3).result(timeout=60)
    handle = result.lease.handle_id
    assert engine.renew(handle, 0.3) is not None
    wait_for(lambda: engine.pool.num_used == 0)
    assert engine.pool.num_cached == 2
    assert engine.leased_blocks(handle) is None
    assert engine.renew(handle, 10) is None
    assert engine.leases.stats().expired == 1

    again = engine.submit("again", prompt, GREEDY).result(timeout=60)
    assert again.seq.num_cached_prompt_tokens == 32, "a retry still hits the cache"
    engine.release(again.lease.handle_id)


def test_first_token_that_finishes_takes_no_lease(engine):
    (prompt,) = make_prompts((20,), seed=13)
    result = engine.submit("one", prompt, SamplingParams(temperature=0.0, max_tokens=1)).result(
        timeout=60
    )
    assert result.lease is None and result.seq.is_finished
    assert engine.pool.num_used == 0


def test_bad_requests_are_refused_before_queueing(engine):
    with pytest.raises(InvalidArgument) as info:
        engine.submit("bad", [], GREEDY)
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(InvalidArgument) as info:
        engine.submit("big", [5] * (64 * 16 + 1), SamplingParams(max_tokens=1))
    assert info.value.field in ("prompt_token_ids", "max_tokens")
    assert not engine.scheduler.has_work()
