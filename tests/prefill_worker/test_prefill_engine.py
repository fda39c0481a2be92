"""PrefillWorker over PrefillEngine on the tiny model: first tokens equal transformers', blocks
are leased in shared memory, and every lease ends (release or expiry) with its blocks in the
prefix cache."""

from __future__ import annotations

import os
import time

import pytest
import torch
from support.oracle import hf_greedy, hf_model, make_engine, make_prompts
from support.waits import wait_until
from transformers import AutoTokenizer

from pagedserve.errors import InvalidArgument
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.prefill_worker.lease_table import LeaseState, LeaseStats
from pagedserve.prefill_worker.worker import PrefillWorker
from pagedserve.sampling_params import SamplingParams, StructuredOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def hf_next_token(model_dir, prompt: list[int]) -> int:
    """transformers' greedy next token after `prompt` (one forward, no generate loop)."""
    with torch.no_grad():
        logits = hf_model(model_dir, torch.float32)(torch.tensor([prompt])).logits
    return int(logits[0, -1].argmax())


def make_worker(model_dir, config: PrefillEngineConfig) -> PrefillWorker:
    return PrefillWorker(PrefillEngine.from_model_dir(str(model_dir), config))


@pytest.fixture
def worker(tiny_llama):
    worker = make_worker(
        tiny_llama, PrefillEngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=128)
    )
    worker.start()
    yield worker
    worker.close()
    worker.engine.pool.check_integrity()


def test_first_tokens_match_transformers_and_kv_is_leased_in_shm(worker, tiny_llama):
    prompts = make_prompts((1, 16, 40, 130, 7), seed=11)
    futures = [worker.submit(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    results = [f.result(timeout=60) for f in futures]
    for prompt, result in zip(prompts, results, strict=True):
        assert (
            result.seq.output_token_ids
            == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0][:1]
        )
        assert result.lease is not None
        assert len(result.lease.resource.block_ids) == -(-len(prompt) // 16)
        assert result.lease_expires_unix_ms > time.time() * 1000
    assert worker.engine.pool.num_used == sum(-(-len(p) // 16) for p in prompts)
    assert os.path.exists(f"/dev/shm/{worker.engine.shm_pool.segment_name}")

    # the leased pages hold the same K/V the decode worker computes for the prompt
    reference = make_engine(tiny_llama, block_size=16, num_blocks=64)
    prompt, result = prompts[3], results[3]
    seq = reference.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    reference.step()
    for i, (mine, theirs) in enumerate(
        zip(result.lease.resource.block_ids, seq.block_table.block_ids, strict=True)
    ):
        tokens = min(16, len(prompt) - i * 16)
        got = worker.engine.runner.kv_cache.tensor[mine][:, :, :tokens]
        want = reference.runner.kv_cache.tensor[theirs][:, :, :tokens]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    reference.abort(seq.request_id)

    for result in results:
        assert worker.release(result.lease.handle_id)
        assert not worker.release(result.lease.handle_id), "release is idempotent"
    assert worker.engine.pool.num_used == 0
    assert worker.engine.pool.num_cached == sum(len(p) // 16 for p in prompts)


def test_lease_release_expiry_renewal_keep_the_pool_whole_and_blocks_cached(worker):
    pa, pb, pc = make_prompts((40, 40, 40), seed=12)
    a = worker.submit("lease-a", pa, GREEDY).result(timeout=60)  # the default 30 s lease
    worker.check_integrity()
    assert worker.engine.pool.num_used == 3
    assert worker.release(a.lease.handle_id)
    assert worker.engine.pool.num_used == 0, "release frees at once"
    worker.check_integrity()
    assert worker.lease_state(a.lease.handle_id) is LeaseState.UNKNOWN

    b = worker.submit("lease-b", pb, GREEDY, lease_seconds=1.0).result(timeout=60)
    c = worker.submit("lease-c", pc, GREEDY, lease_seconds=1.0).result(timeout=60)
    renewed_ms = worker.renew(c.lease.handle_id, 30)
    assert renewed_ms is not None and renewed_ms > c.lease_expires_unix_ms + 20_000
    if time.time() * 1000 < b.lease_expires_unix_ms - 100:
        assert worker.engine.pool.num_used == 6, "nothing is freed before the deadline"
    assert wait_until(lambda: worker.engine.pool.num_used == 3, 5.0), "condition not met in time"
    assert time.time() * 1000 >= b.lease_expires_unix_ms - 50
    worker.check_integrity()
    assert worker.lease_state(b.lease.handle_id) is LeaseState.EXPIRED
    assert worker.leased_blocks(b.lease.handle_id) is None
    assert worker.renew(b.lease.handle_id, 10) is None, "an expired lease cannot come back"
    assert worker.leased_blocks(c.lease.handle_id) == c.lease.resource.block_ids
    assert worker.leases.stats() == LeaseStats(granted=3, released=1, expired=1, active=1)

    assert worker.release(c.lease.handle_id)
    worker.check_integrity()
    assert (worker.engine.pool.num_used, worker.engine.pool.num_cached) == (0, 6)
    for i, prompt in enumerate((pa, pb, pc)):
        again = worker.submit(f"again-{i}", prompt, GREEDY).result(timeout=60)
        assert again.seq.num_cached_prompt_tokens == 32, "a retry still hits the cache"
        worker.release(again.lease.handle_id)
    worker.check_integrity()


def test_warmup_caches_full_blocks_for_the_first_request_that_uses_them(worker):
    system, user = make_prompts((40, 5), seed=14)
    assert worker.warmup([system, system[:20]]) == 2, "distinct full blocks"
    assert worker.engine.pool.num_used == 0 and worker.leases.stats().granted == 0
    result = worker.submit("user", system + user, GREEDY).result(timeout=60)
    assert result.seq.num_cached_prompt_tokens == 32
    worker.release(result.lease.handle_id)
    with pytest.raises(InvalidArgument):
        worker.warmup([[]])


def test_sixteen_mixed_length_prompts_in_one_step_match_one_at_a_time(tiny_llama):
    lens = (1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 50, 64, 65, 90, 100, 127)
    prompts = make_prompts(lens, seed=15)
    config = PrefillEngineConfig(
        num_blocks=128, max_num_batched_tokens=1024, enable_prefix_caching=False, use_shm=False
    )
    worker = make_worker(tiny_llama, config)  # no loop: steps by hand
    try:
        futures = [worker.submit(f"b{i}", p, GREEDY) for i, p in enumerate(prompts)]
        assert worker.step() == sum(lens), "all 16 prompts in one step"
        batched = [f.result(timeout=0) for f in futures]
        for result in batched:
            worker.release(result.lease.handle_id)
        alone = []
        for i, prompt in enumerate(prompts):
            future = worker.submit(f"a{i}", prompt, GREEDY)
            assert worker.step() == len(prompt)
            alone.append(future.result(timeout=0))
            worker.release(alone[-1].lease.handle_id)
        worker.check_integrity()
    finally:
        worker.close()
    first = [r.seq.output_token_ids for r in batched]
    assert first == [r.seq.output_token_ids for r in alone]
    assert first == [[hf_next_token(tiny_llama, p)] for p in prompts]


def test_a_prompt_longer_than_the_budget_is_chunked_and_exact(tiny_llama):
    (prompt,) = make_prompts((150,), seed=16)
    results, kv = [], []
    for budget, steps in ((32, 5), (2048, 1)):
        config = PrefillEngineConfig(num_blocks=16, max_num_batched_tokens=budget, use_shm=False)
        worker = make_worker(tiny_llama, config)
        try:
            future = worker.submit("long", prompt, GREEDY)
            assert [worker.step() for _ in range(steps)][-1] == 150 - (steps - 1) * budget
            result = future.result(timeout=0)
            pages = worker.engine.runner.kv_cache.tensor[result.lease.resource.block_ids]
            # pages: [block, layer, k/v, slot, head, dim]; the last block holds 150 - 9 * 16 = 6
            kv.append(torch.cat([pages[:-1].flatten(), pages[-1][:, :, :6].flatten()]))
            results.append(result.seq.output_token_ids)
            worker.release(result.lease.handle_id)
            worker.check_integrity()
        finally:
            worker.close()
    assert results[0] == results[1] == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0][:1]
    torch.testing.assert_close(kv[0], kv[1], atol=1e-5, rtol=1e-5)


def test_abort_after_the_first_token_ends_the_lease_its_caller_never_saw(worker):
    # NOTE: a caller whose Prefill call ended without the answer can only name the request
    (prompt,) = make_prompts((40,), seed=14)
    done = worker.submit("lost", prompt, GREEDY).result(timeout=60)
    assert done.lease is not None and worker.engine.pool.num_used == 3
    assert worker.abort("lost")
    assert worker.engine.pool.num_used == 0
    worker.check_integrity()
    assert worker.lease_state(done.lease.handle_id) is LeaseState.UNKNOWN
    assert not worker.abort("lost"), "idempotent"
    assert worker.leases.stats() == LeaseStats(granted=1, released=1, expired=0, active=0)


def test_first_token_that_finishes_takes_no_lease(worker):
    (prompt,) = make_prompts((20,), seed=13)
    result = worker.submit("one", prompt, SamplingParams(temperature=0.0, max_tokens=1)).result(
        timeout=60
    )
    assert result.lease is None and result.seq.is_finished
    assert worker.engine.pool.num_used == 0


def test_bad_requests_are_refused_before_queueing(worker):
    with pytest.raises(InvalidArgument) as info:
        worker.submit("bad", [], GREEDY)
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(InvalidArgument) as info:
        worker.submit("big", [5] * (64 * 16 + 1), SamplingParams(max_tokens=1))
    assert info.value.field in ("prompt_token_ids", "max_tokens")
    assert not worker.engine.scheduler.has_work()


def test_the_engine_alone_steps_without_a_thread_and_hands_prompts_back(tiny_llama):
    config = PrefillEngineConfig(num_blocks=16, max_num_batched_tokens=32, use_shm=False)
    engine = PrefillEngine.from_model_dir(str(tiny_llama), config)
    (prompt,) = make_prompts((40,), seed=17)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=4)
    seq = engine.new_sequence(prompt, seeded, request_id="alone")
    engine.add_sequence(seq)
    outputs = [engine.step() for _ in range(2)]
    assert [out.plan.num_batched_tokens for out in outputs] == [32, 8]
    assert outputs[0].done == [] and outputs[1].done == [seq]
    assert seq.num_output_tokens == 1 and not engine.has_unfinished
    assert engine.runner.sampler.num_generators == 0, "a handed-back prompt keeps no generator"
    assert engine.pool.num_used == 3, "its blocks are the caller's until freed"
    engine.free(seq.block_table)
    engine.check_integrity()
    assert engine.pool.num_used == 0


def test_a_structured_first_token_follows_its_grammar_and_leaves_no_matcher(tiny_llama):
    config = PrefillEngineConfig(num_blocks=16, max_num_batched_tokens=64, use_shm=False)
    engine = PrefillEngine.from_model_dir(str(tiny_llama), config)
    (prompt,) = make_prompts((20,), seed=5)
    grammar = StructuredOutput("choice", choices=("yes", "no"))
    seq = engine.new_sequence(prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                     structured_output=grammar),
                              request_id="choice")  # fmt: skip
    engine.add_sequence(seq)
    while engine.has_unfinished:
        engine.step()
    first = AutoTokenizer.from_pretrained(tiny_llama).decode(seq.output_token_ids)
    assert first and ("yes".startswith(first) or "no".startswith(first)), first
    assert engine.runner.sampler.grammars.num_matchers == 0, "a handed-back prompt keeps none"
    engine.free(seq.block_table)
    engine.check_integrity()
