"""Decode scheduler policy without a model: exact block ids, token counts and queue moves.

The "runner" here is `step()`, which samples token 7 for every sequence whose chunk completes.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.decode_worker.plan import (
    DecodePlan,
    KVPolicy,
    PreemptionMode,
    SchedulerConfig,
    SchedulingPolicy,
)
from pagedserve.decode_worker.preemption import PreemptionCostModel
from pagedserve.decode_worker.scheduler import Scheduler
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import RunnerOutput, SampledToken
from pagedserve.model.requests.sequence import FinishReason, RequestId, Sequence, SequenceStatus
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
SWAP, RECOMPUTE, AUTO = PreemptionMode.SWAP, PreemptionMode.RECOMPUTE, PreemptionMode.AUTO


def make_scheduler(
    num_blocks: int = 4,
    num_host_blocks: int | None = 4,
    mode: PreemptionMode = SWAP,
    cost_model: PreemptionCostModel | None = None,
    **config: object,
) -> Scheduler:
    pool = BlockPool(num_blocks, BLOCK_SIZE, record_events=False)
    host = BlockPool(num_host_blocks, BLOCK_SIZE, record_events=False) if num_host_blocks else None
    settings: dict = {"max_model_len": 256, "preemption_mode": mode, "bytes_per_block": 100}
    settings.update(config)
    return Scheduler(SchedulerConfig(**settings), KVCacheManager(pool), host, cost_model)


def make_seq(
    scheduler: Scheduler, name: str, prompt: list[int], *, max_tokens: int = 16, priority: int = 0
) -> Sequence:
    seq = Sequence(
        request_id=RequestId(name),
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        block_table=BlockTable(scheduler.pool),
        model_fingerprint=bytes(16),
        priority=priority,
    )
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> tuple[DecodePlan, list[Sequence]]:
    """One schedule + fake forward + update, with an integrity check after each half."""
    plan = scheduler.schedule()
    scheduler.check_integrity()
    sampled = [SampledToken(7, None) if item.completes else None for item in plan.scheduled]
    finished = scheduler.update(plan, RunnerOutput(sampled=sampled))
    scheduler.check_integrity()
    return plan, finished


def scheduled(plan: DecodePlan) -> dict[str, int]:
    return {item.seq.request_id: item.num_new_tokens for item in plan.scheduled}


def preempted(plan: DecodePlan) -> list[tuple[str, PreemptionMode, int]]:
    return [(p.seq.request_id, p.mode, p.num_blocks) for p in plan.preempted]


def two_full_sequences(scheduler: Scheduler) -> tuple[Sequence, Sequence]:
    """High-priority `high` (blocks 0, 1; admitted first) and low-priority `low` (blocks 2, 3),
    8 tokens each, computed: each needs a new block for its next token and the pool is full."""
    low = make_seq(scheduler, "low", list(range(10, 18)), max_tokens=8, priority=5)
    high = make_seq(scheduler, "high", list(range(20, 28)), max_tokens=2, priority=0)
    plan, _ = step(scheduler)
    assert scheduled(plan) == {"high": 8, "low": 8}
    assert (high.block_table.block_ids, low.block_table.block_ids) == ([0, 1], [2, 3])
    return low, high


def test_running_sequence_short_of_a_block_swaps_out_the_lower_priority_one():
    scheduler = make_scheduler(mode=SWAP)
    low, high = two_full_sequences(scheduler)

    plan = scheduler.schedule()

    assert preempted(plan) == [("low", SWAP, 2)]
    assert plan.swap_out == [(2, 0), (3, 1)]
    assert scheduled(plan) == {"high": 1}
    # freed tail first into the prefix cache (both blocks are full and hashed): 3 is evicted first
    assert high.block_table.block_ids == [0, 1, 3]
    finished = scheduler.update(plan, RunnerOutput([SampledToken(7, None)]))
    scheduler.check_integrity()
    assert low.status is SequenceStatus.SWAPPED and low.num_computed_tokens == 8
    assert finished == [high] and high.finish_reason is FinishReason.LENGTH
    assert scheduler.stats.num_swap_out_blocks == 2 and scheduler.stats.num_swap_out_bytes == 200


def test_swapped_sequence_comes_back_reusing_its_block_still_cached_on_the_device():
    scheduler = make_scheduler(mode=SWAP)
    low, _ = two_full_sequences(scheduler)
    step(scheduler)  # low swapped out; its block 2 stays cached, block 3 went to `high`

    plan, _ = step(scheduler)

    assert plan.swapped_in == [low]
    # high finished: its partial block 3 is free, 1 and 0 are cached behind low's block 2
    assert plan.swap_in == [(1, 3)]  # host block 1 -> device block 3; block 2 re-acquired
    assert scheduler.stats.num_swap_in_cache_hits == 1
    assert low.block_table.block_ids == [2, 3, 1]  # + a block for token 8, evicted from the LRU
    assert scheduled(plan) == {"low": 1}
    assert scheduler.host_pool is not None and scheduler.host_pool.num_used == 0


def test_recompute_victim_releases_its_blocks_and_resumes_through_the_prefix_cache():
    scheduler = make_scheduler(mode=RECOMPUTE)
    low, high = two_full_sequences(scheduler)

    plan = scheduler.schedule()
    assert preempted(plan) == [("low", RECOMPUTE, 2)]
    assert plan.swap_out == [] and high.block_table.block_ids == [0, 1, 3]
    assert low.status is SequenceStatus.WAITING and low.num_computed_tokens == 0
    scheduler.update(plan, RunnerOutput([SampledToken(7, None)]))

    plan, _ = step(scheduler)
    assert plan.recomputed == [low]
    # 9 tokens: block 2 still cached (prefix hit), the other 5 tokens are computed again
    assert scheduled(plan) == {"low": 5}
    assert low.block_table.block_ids == [2, 3, 1] and low.num_computed_tokens == 4 + 5
    assert low.num_cached_prompt_tokens == 0  # usage counts the first admission only


def test_full_swap_space_falls_back_to_recompute():
    scheduler = make_scheduler(num_host_blocks=1, mode=SWAP)
    two_full_sequences(scheduler)
    plan, _ = step(scheduler)
    assert preempted(plan) == [("low", RECOMPUTE, 2)]
    assert scheduler.stats.num_preemptions_recompute == 1
    assert scheduler.stats.num_preemptions_swap == 0


def test_no_swap_space_means_recompute():
    scheduler = make_scheduler(num_host_blocks=None, mode=SWAP)
    two_full_sequences(scheduler)
    plan, _ = step(scheduler)
    assert preempted(plan) == [("low", RECOMPUTE, 2)]


@pytest.mark.parametrize(
    ("bytes_per_s", "want"),
    [(1e9, SWAP), (1e3, RECOMPUTE)],  # 2 blocks * 100 B out and back in vs 8 tokens at 1k/s
)
def test_auto_mode_follows_the_cost_model(bytes_per_s, want):
    model = PreemptionCostModel(
        swap_bytes_per_s=bytes_per_s, prefill_tokens_per_s=1e3, swap_overhead_s=0.0, measure=False
    )
    assert model.prefers_swap(2, 100, 8) is (want is SWAP)
    scheduler = make_scheduler(mode=AUTO, cost_model=model)
    two_full_sequences(scheduler)
    plan, _ = step(scheduler)
    assert preempted(plan) == [("low", want, 2)]


def test_cost_model_blends_measured_speeds():
    model = PreemptionCostModel(swap_bytes_per_s=1e9, prefill_tokens_per_s=1e3, smoothing=0.5)
    model.observe_swap(3_000_000_000, 1.0)
    model.observe_prefill(3000, 1.0)
    assert (model.swap_bytes_per_s, model.prefill_tokens_per_s) == (2e9, 2e3)
    fixed = PreemptionCostModel(measure=False)
    fixed.observe_swap(1, 1.0)
    assert fixed.swap_bytes_per_s == PreemptionCostModel().swap_bytes_per_s


def fill_seats(scheduler: Scheduler, priority: int) -> list[Sequence]:
    seqs = [
        make_seq(scheduler, f"low{i}", list(range(30 + 10 * i, 33 + 10 * i)), priority=priority)
        for i in range(2)
    ]
    step(scheduler)
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2
    return seqs


def test_high_priority_arrival_preempts_the_newest_low_priority_and_starts_this_step():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=2)
    low0, low1 = fill_seats(scheduler, priority=5)
    high = make_seq(scheduler, "high", [1, 2, 3, 4, 5], priority=0)

    plan, _ = step(scheduler)

    assert preempted(plan) == [("low1", SWAP, 1)]
    assert scheduled(plan) == {"low0": 1, "high": 5}
    assert high.num_output_tokens == 1 and low1.status is SequenceStatus.SWAPPED


def test_equal_priority_arrival_waits_for_a_seat_instead_of_preempting():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2)
    fill_seats(scheduler, priority=3)
    late = make_seq(scheduler, "late", [1, 2, 3], max_tokens=1, priority=3)
    for _ in range(20):
        plan, _ = step(scheduler)
        assert plan.preempted == []
        if late.is_finished:
            break
    # it ran only once a seat freed (each low request generates 16 tokens)
    assert late.is_finished and scheduler.stats.num_preemptions == 0


def test_priority_gap_below_minimum_does_not_preempt():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=2, min_priority_gap=2)
    fill_seats(scheduler, priority=3)
    make_seq(scheduler, "nearly", [1, 2, 3], priority=2)
    plan, _ = step(scheduler)
    assert plan.preempted == [] and "nearly" not in scheduled(plan)


def test_fcfs_ignores_priority():
    scheduler = make_scheduler(
        num_blocks=8, max_num_seqs=2, policy=SchedulingPolicy.FCFS, mode=SWAP
    )
    fill_seats(scheduler, priority=5)
    make_seq(scheduler, "high", [1, 2, 3], priority=0)
    plan, _ = step(scheduler)
    assert plan.preempted == [] and "high" not in scheduled(plan)


def test_a_request_preempted_max_times_is_no_longer_a_victim():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=2, max_preemptions=1)
    fill_seats(scheduler, priority=5)
    make_seq(scheduler, "high0", [1, 2, 3], max_tokens=1, priority=0)
    plan, _ = step(scheduler)
    assert preempted(plan) == [("low1", SWAP, 1)]
    assert scheduler.num_preemptions_of("low1") == 1
    # high0 finished this step; low1 swaps back in, then a second high arrival comes
    plan, _ = step(scheduler)
    assert [s.request_id for s in plan.swapped_in] == ["low1"]
    make_seq(scheduler, "high1", [4, 5, 6], priority=0)
    plan, _ = step(scheduler)
    assert preempted(plan)[0][:2] == ("low0", SWAP)  # low1 is protected, low0 is the victim
    make_seq(scheduler, "high2", [7, 8, 9], priority=0)
    plan, _ = step(scheduler)
    assert plan.preempted == []  # low0 and low1 are both protected now


def test_request_that_cannot_fit_even_alone_finishes_with_an_error():
    scheduler = make_scheduler(num_blocks=4)
    seq = make_seq(scheduler, "huge", list(range(10, 20)), max_tokens=7)  # 17 tokens > 16 slots
    assert seq.finish_reason is FinishReason.ERROR
    plan, _ = step(scheduler)
    assert [f.seq for f in plan.failed] == [seq]
    assert "KV cache holds only 4 blocks" in plan.failed[0].message
    assert "lower max_tokens" in plan.failed[0].message
    assert not scheduler.has_unfinished and scheduler.stats.num_failed == 1


def test_abort_frees_device_and_host_blocks_exactly_once():
    scheduler = make_scheduler(mode=SWAP)
    low, high = two_full_sequences(scheduler)
    step(scheduler)  # low is swapped: 2 host blocks
    assert scheduler.host_pool is not None and scheduler.host_pool.num_used == 2

    assert scheduler.abort("low") is True
    assert scheduler.abort("low") is False
    scheduler.check_integrity()
    assert scheduler.host_pool.num_used == 0 and scheduler.pool.num_used == 0
    assert low.finish_reason is FinishReason.ABORT and not scheduler.has_unfinished
    assert scheduler.abort("high") is False  # already finished


def test_abort_of_a_running_and_a_waiting_request():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    running = make_seq(scheduler, "run", [1, 2, 3, 4, 5])
    waiting = make_seq(scheduler, "wait", [6, 7, 8])
    step(scheduler)
    assert scheduler.pool.num_used == 2
    assert scheduler.abort("run") and scheduler.abort("wait")
    scheduler.check_integrity()
    assert scheduler.pool.num_used == 0 and not scheduler.has_unfinished
    assert running.finish_reason is waiting.finish_reason is FinishReason.ABORT


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=16)
    seq = make_seq(scheduler, "long", list(range(100, 140)), max_tokens=2)
    chunks = [scheduled(step(scheduler)[0])["long"] for _ in range(3)]
    assert chunks == [16, 16, 8] and seq.num_output_tokens == 1


def test_prefill_chunk_shrinks_to_the_blocks_left_instead_of_preempting():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=12)
    other = make_seq(scheduler, "other", list(range(100, 105)), max_tokens=8)
    long = make_seq(scheduler, "long", list(range(200, 220)), max_tokens=1)
    plan, _ = step(scheduler)
    assert scheduled(plan) == {"other": 5, "long": 7}
    assert (other.block_table.block_ids, long.block_table.block_ids) == ([0, 1], [2, 3])

    plan, _ = step(scheduler)

    # long wants 11 tokens (3 more blocks), only 2 blocks are left: it takes 9, nobody is preempted
    assert scheduled(plan) == {"other": 1, "long": 9}
    assert plan.preempted == [] and long.block_table.block_ids == [2, 3, 4, 5]


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_finish_with_every_block_returned(seed):
    """Random pools, limits, modes and priorities (outputs are all token 7, so full blocks are
    shared between sequences a lot): every request finishes with all its tokens, no livelock."""
    rng = random.Random(seed)
    num_blocks = rng.randint(6, 24)
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        num_host_blocks=rng.choice([None, 2, num_blocks]),
        mode=rng.choice(list(PreemptionMode)),
        policy=rng.choice(list(SchedulingPolicy)),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([4, 16, 64]),
        max_preemptions=rng.randint(0, 3),
        min_priority_gap=rng.randint(1, 2),
    )
    seqs = []
    for i in range(rng.randint(2, 10)):
        prompt = [rng.choice([1, 2]) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, num_blocks * BLOCK_SIZE - len(prompt))
        seqs.append(
            make_seq(scheduler, f"r{i}", prompt, max_tokens=max_tokens, priority=rng.randint(0, 3))
        )
    for _ in range(3000):
        if not scheduler.has_unfinished:
            break
        if rng.random() < 0.03:
            scheduler.abort(rng.choice(seqs).request_id)
        step(scheduler)
    assert not scheduler.has_unfinished, "livelock"
    assert scheduler.pool.num_used == 0
    assert scheduler.host_pool is None or scheduler.host_pool.num_used == 0
    for seq in seqs:
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.params.max_tokens
        else:
            assert seq.finish_reason is FinishReason.ABORT


def test_swapped_sequences_pinning_shared_blocks_are_recomputed_when_nothing_can_run():
    scheduler = make_scheduler(num_blocks=4, num_host_blocks=8, mode=SWAP)
    shared = [9, 9, 9, 9]
    x = make_seq(scheduler, "x", [*shared, 1], max_tokens=3, priority=5)
    step(scheduler)
    y = make_seq(scheduler, "y", [*shared, 2], max_tokens=3, priority=5)
    step(scheduler)
    assert (x.block_table.block_ids, y.block_table.block_ids) == ([0, 1], [0, 2])
    s = make_seq(scheduler, "s", list(range(20, 32)), max_tokens=4, priority=0)
    plan, _ = step(scheduler)  # s displaces y and x; block 0 stays, pinned by both records
    assert preempted(plan) == [("y", SWAP, 1), ("x", SWAP, 1)]
    assert s.block_table.block_ids == [3, 2, 1]
    plan, _ = step(scheduler)  # s needs a 4th block, only block 0 exists: s swaps itself out
    assert preempted(plan) == [("s", SWAP, 3)] and plan.scheduled == []

    plan, _ = step(scheduler)

    # nothing runs and s cannot come back while x and y pin block 0: they go to recompute
    assert scheduler.stats.num_swapped_recomputed == 2
    assert x.status is y.status is SequenceStatus.WAITING
    assert plan.swapped_in == [s] and plan.swap_in == []  # s's 3 blocks were still cached
    assert scheduler.stats.num_swap_in_cache_hits == 3 and scheduled(plan) == {"s": 1}
    while scheduler.has_unfinished:
        step(scheduler)
    assert [q.num_output_tokens for q in (x, y, s)] == [3, 3, 4]


def make_prefilled(scheduler: Scheduler, name: str, prompt: list[int]) -> Sequence:
    """An imported prompt: its table holds the prompt's KV, the first token is appended."""
    seq = Sequence(
        request_id=RequestId(name),
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        block_table=BlockTable(scheduler.pool),
        model_fingerprint=bytes(16),
    )
    assert scheduler.kv.allocate(seq.block_table, len(prompt)) == []
    seq.num_computed_tokens = len(prompt)
    scheduler.kv.cache_full_blocks(seq.block_table, seq.block_hashes, len(prompt))
    seq.append_token(9, None)
    scheduler.add_prefilled(seq)
    return seq


def test_prefilled_sequence_decodes_its_next_token_in_the_first_step():
    scheduler = make_scheduler(num_blocks=8)
    seq = make_prefilled(scheduler, "imported", list(range(1, 7)))  # 6 tokens: blocks 0, 1
    assert seq.status is SequenceStatus.RUNNING and seq.block_table.block_ids == [0, 1]
    plan, _ = step(scheduler)
    assert scheduled(plan) == {"imported": 1}  # the first token only: nothing recomputed
    assert seq.output_token_ids == [9, 7] and seq.block_table.block_ids == [0, 1]


def test_prefilled_sequence_without_a_seat_waits_and_reuses_its_cached_blocks():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    make_seq(scheduler, "running", [1, 2], max_tokens=2)
    step(scheduler)
    seq = make_prefilled(scheduler, "imported", list(range(1, 10)))  # 9 tokens: 2 full blocks
    assert seq.status is SequenceStatus.WAITING and seq.block_table.block_ids == []
    assert scheduler.pool.num_cached == 2  # its full blocks stay cached by hash
    step(scheduler)  # "running" finishes
    plan, _ = step(scheduler)
    assert scheduled(plan) == {"imported": 2}  # token 8 and the first token; 8 tokens were hits


# -- kv_policy=reserve-max: the benchmark baseline on the same scheduler ------------------------


def test_reserve_max_holds_the_worst_case_from_admission_and_never_preempts():
    sched = make_scheduler(num_blocks=8, kv_policy=KVPolicy.RESERVE_MAX)
    a = make_seq(sched, "a", list(range(10, 15)), max_tokens=11)  # 16 tokens: 4 blocks
    b = make_seq(sched, "b", list(range(20, 25)), max_tokens=11)  # 4 blocks
    c = make_seq(sched, "c", list(range(30, 35)), max_tokens=3)  # 8 tokens: 2 blocks

    plan, _ = step(sched)
    # a and b reserve 4 blocks each: the pool is full, c waits although paged KV would seat it
    assert scheduled(plan) == {"a": 5, "b": 5}
    assert len(a.block_table.block_ids) == len(b.block_table.block_ids) == 4
    assert c.status is SequenceStatus.WAITING and sched.pool.num_free == 0
    finished: list[Sequence] = []
    while len(finished) < 2:
        plan, done = step(sched)
        assert not plan.preempted and "c" not in scheduled(plan)
        finished += done
    assert {s.request_id for s in finished} == {"a", "b"}
    while sched.has_unfinished:
        step(sched)
    assert c.output_token_ids == [7] * 3
    assert sched.stats.num_preemptions == 0 and sched.pool.num_used == 0


def test_paged_policy_seats_what_reserve_max_cannot():
    sched = make_scheduler(num_blocks=8)
    for name, base in (("a", 10), ("b", 20), ("c", 30)):
        make_seq(sched, name, list(range(base, base + 5)), max_tokens=11 if name != "c" else 3)
    plan, _ = step(sched)
    assert scheduled(plan) == {"a": 5, "b": 5, "c": 5}
