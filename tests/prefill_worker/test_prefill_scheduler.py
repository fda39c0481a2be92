"""PrefillScheduler policy with exact block ids; no model (sampled tokens are made up)."""

from __future__ import annotations

from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import RunnerOutput, SampledToken, StepPlan
from pagedserve.model.requests.sequence import RequestId, Sequence
from pagedserve.prefill_worker.scheduler import (
    PrefillScheduler,
    PrefillSchedulerConfig,
)
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def make_scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=4):
    pool = BlockPool(num_blocks, block_size, record_events=False)
    kv = KVCacheManager(pool)
    config = PrefillSchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return PrefillScheduler(kv, config, eos_token_ids=(1,), max_model_len=1024), pool


def make_seq(pool, rid, n, priority=0, start=10):
    return Sequence(
        request_id=RequestId(rid),
        prompt_token_ids=list(range(start, start + n)),
        params=GREEDY,
        block_table=BlockTable(pool),
        model_fingerprint=b"fp",
        priority=priority,
    )


def run(scheduler, plan, token=7):
    """Pretend the model ran: sample `token` for every chunk that completes its prompt."""
    sampled = [SampledToken(token, None) if item.completes else None for item in plan.scheduled]
    return scheduler.update(plan, RunnerOutput(sampled=sampled))


def test_priority_then_arrival_order_and_chunking_under_the_budget():
    scheduler, pool = make_scheduler(budget=8)
    low = make_seq(pool, "low", 6, priority=5)
    high = make_seq(pool, "high", 10, priority=0, start=100)
    later = make_seq(pool, "later", 3, priority=0, start=200)
    for seq in (low, high, later):
        scheduler.add(seq)

    plan = scheduler.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in plan.scheduled] == [("high", 8)]
    assert high.block_table.block_ids == [0, 1]
    assert run(scheduler, plan) == []

    plan = scheduler.schedule()  # the started prompt continues first, then the next in order
    assert [(i.seq.request_id, i.num_new_tokens) for i in plan.scheduled] == [
        ("high", 2),
        ("later", 3),
        ("low", 3),
    ]
    assert high.block_table.block_ids == [0, 1, 2]
    assert later.block_table.block_ids == [3]
    assert low.block_table.block_ids == [4]
    done = run(scheduler, plan)
    assert [s.request_id for s in done] == ["high", "later"]
    assert high.output_token_ids == [7] and high.num_computed_tokens == 10
    pool.check_integrity()
    # done prompts still hold their blocks: the caller leases them
    assert pool.num_used == 5


def test_prefix_hit_computes_only_the_suffix():
    scheduler, pool = make_scheduler(budget=64)
    first = make_seq(pool, "a", 9)
    scheduler.add(first)
    (done,) = run(scheduler, scheduler.schedule())
    scheduler.kv.free(done.block_table)  # lease released: full blocks stay cached
    assert pool.num_cached == 2

    second = make_seq(pool, "b", 11)  # same first 8 tokens
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in plan.scheduled] == [("b", 3)]
    assert second.num_cached_prompt_tokens == 8
    assert second.block_table.block_ids[:2] == [0, 1]


def test_abort_frees_blocks_of_a_started_prompt_and_skips_a_queued_one():
    scheduler, pool = make_scheduler(budget=4)
    started = make_seq(pool, "started", 10)
    queued = make_seq(pool, "queued", 3)
    scheduler.add(started)
    scheduler.add(queued)
    run(scheduler, scheduler.schedule())
    assert pool.num_used == 1
    assert scheduler.abort("started") is started
    assert scheduler.abort("queued") is queued
    assert scheduler.abort("unknown") is None
    assert pool.num_used == 0 and not scheduler.has_work()
    assert scheduler.schedule().scheduled == []


def test_a_full_pool_waits_instead_of_failing():
    scheduler, pool = make_scheduler(num_blocks=2, budget=16)
    a = make_seq(pool, "a", 8)
    b = make_seq(pool, "b", 4, start=50)
    scheduler.add(a)
    scheduler.add(b)
    (done,) = run(scheduler, scheduler.schedule())
    assert done is a and scheduler.schedule().scheduled == []  # a's blocks are leased
    scheduler.kv.free(a.block_table)
    plan = scheduler.schedule()
    assert [i.seq.request_id for i in plan.scheduled] == ["b"]
    assert scheduler.queued_tokens == 4


def test_a_prompt_aborted_while_its_chunk_runs_is_skipped_by_update():
    scheduler, pool = make_scheduler(budget=16)
    kept = make_seq(pool, "kept", 8)
    gone = make_seq(pool, "gone", 8, start=50)
    scheduler.add(kept)
    scheduler.add(gone)
    plan = scheduler.schedule()
    assert gone.block_table.block_ids == [2, 3]
    scheduler.abort("gone")  # a client cancel while the forward runs without the lock
    again = make_seq(pool, "gone", 8, start=50)  # and a retry under the same id, queued
    scheduler.add(again)
    assert [s.request_id for s in run(scheduler, plan)] == ["kept"]
    assert gone.num_computed_tokens == 0 and again.num_computed_tokens == 0
    assert pool.num_used == 2 and pool.num_cached == 0  # nothing of "gone" was registered
    assert scheduler.is_in_flight(again) and not scheduler.is_in_flight(gone)
    pool.check_integrity()


def test_a_chunk_is_registered_only_when_its_step_is_applied():
    scheduler, pool = make_scheduler(budget=8)
    seq = make_seq(pool, "a", 12)
    scheduler.add(seq)
    plan = scheduler.schedule()  # the forward of this plan "fails": update is never called
    assert seq.block_table.block_ids == [0, 1] and pool.num_cached == 0
    (item,) = plan.scheduled
    assert run(scheduler, StepPlan([item], [])) == []  # the chunk run alone, then applied
    assert seq.num_computed_tokens == 8 and seq.block_table.num_cached_blocks == 2
    plan = scheduler.schedule()  # the last 4 tokens; this forward fails and the prompt ends
    assert seq.block_table.block_ids == [0, 1, 2]
    scheduler.abort("a")
    assert pool.num_cached == 2 and pool.num_free == 14  # only the applied chunk's blocks
    pool.check_integrity()
