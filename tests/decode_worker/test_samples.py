"""Several samples of one prompt (n / best_of) in the DecodeEngine: the prompt is computed once,
every sample's table shares its blocks (copy-on-write of the partial last block), a group is
preempted and aborted as one, and greedy samples equal transformers token for token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.oracle import hf_beams, hf_greedy

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.model.requests.sequence import FinishReason, Sequence, sample_request_id
from pagedserve.sampling_params import SamplingParams, sample_seed

BLOCK_SIZE = 4


def make_engine(model_dir: Path, **overrides) -> DecodeEngine:
    settings: dict = {
        "block_size": BLOCK_SIZE,
        "num_blocks": 400,
        "num_swap_blocks": 0,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 32,
        "measure_costs": False,
    }
    settings.update(overrides)
    return DecodeEngine.from_model_dir(str(model_dir), DecodeEngineConfig(**settings))


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def samples_of(seq: Sequence) -> list[Sequence]:
    assert seq.group is not None, "the request was not forked into samples"
    return seq.group.members


def run(engine: DecodeEngine, *, check_every_step: bool = True) -> None:
    while engine.has_unfinished:
        engine.step()
        if check_every_step:
            engine.check_integrity()
    engine.check_integrity()
    assert engine.pool.num_used == 0, "finished samples must hold no device blocks"
    assert engine.swap_space is None or engine.swap_space.pool.num_used == 0
    engine.close()


def assert_same_under_pressure(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams, **pressure
) -> None:
    """Every sample of every prompt (priorities alternating) is the same with a pool small
    enough to preempt (`pressure`) as with a roomy one."""

    def outputs(**overrides) -> tuple[list[list[list[int]]], DecodeEngine]:
        engine = make_engine(model_dir, **overrides)
        seqs = [engine.add_request(p, params, priority=i % 2) for i, p in enumerate(prompts)]
        run(engine)
        return [[m.output_token_ids for m in samples_of(s)] for s in seqs], engine

    expected, _ = outputs()
    got, engine = outputs(num_swap_blocks=120, **pressure)
    assert engine.stats.num_preemptions > 0, "the test must exercise preemption"
    assert got == expected


def test_greedy_samples_are_identical_and_equal_transformers(tiny_llama: Path) -> None:
    tokens = prompt(23)
    engine = make_engine(tiny_llama)
    seq = engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=32, n=4))
    run(engine)
    expected, _ = hf_greedy(tiny_llama, torch.float32, tuple(tokens))
    members = samples_of(seq)
    assert [m.sample_index for m in members] == [0, 1, 2, 3]
    assert [m.request_id for m in members] == [
        sample_request_id(seq.request_id, i) for i in range(4)
    ]
    for member in members:
        assert member.output_token_ids == expected
        assert member.finish_reason is FinishReason.LENGTH


def test_prompt_blocks_are_held_once_during_decode(tiny_llama: Path) -> None:
    """n = 8 on a 500-token prompt: full prompt blocks at ref count 8, one partial-block copy
    per sample but the last writer, peak blocks = prompt blocks + 8 x output blocks."""
    n, prompt_len, new = 8, 500, 16
    engine = make_engine(tiny_llama, num_blocks=600, max_num_batched_tokens=1024)
    seq = engine.add_request(
        prompt(prompt_len, 1), SamplingParams(temperature=0.0, max_tokens=new, n=n)
    )
    engine.step()  # the prompt, once, and the first token of every sample
    members = samples_of(seq)
    full = prompt_len // BLOCK_SIZE
    assert len(members) == n
    for block in seq.block_table.block_ids[:full]:
        assert engine.pool.ref_count(block) == n
    assert engine.pool.num_used == -(-prompt_len // BLOCK_SIZE)  # nothing copied yet
    peak = 0
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, engine.pool.num_used)
        engine.check_integrity()
        if engine.has_unfinished:
            for block in members[0].block_table.block_ids[:full]:
                assert engine.pool.ref_count(block) == sum(not m.is_finished for m in members)
    # the 1 + 15 tokens of each sample from position 500: blocks 125.. of its own (500 % 4 == 0)
    per_sample = -(-(prompt_len + new - 1) // BLOCK_SIZE) - full
    assert peak == full + n * per_sample
    run(engine)


def test_partial_last_block_is_copied_on_first_divergent_write(tiny_llama: Path) -> None:
    n, prompt_len = 4, 10  # 2 full blocks + a partial one of 2 tokens
    engine = make_engine(tiny_llama)
    seq = engine.add_request(
        prompt(prompt_len, 2), SamplingParams(temperature=0.0, max_tokens=8, n=n)
    )
    engine.step()
    partial = seq.block_table.block_ids[-1]
    assert engine.pool.ref_count(partial) == n
    out = engine.step()  # every sample writes its first token into the shared partial block
    assert len(out.plan.copies) == n - 1  # the last writer keeps the original
    tails = {m.block_table.block_ids[2] for m in samples_of(seq)}
    assert len(tails) == n and partial in tails
    run(engine)


def test_seeded_samples_are_reproducible_and_differ(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, n=4, ignore_eos=True)

    def outputs() -> list[list[int]]:
        engine = make_engine(tiny_llama)
        seq = engine.add_request(prompt(17, 3), params)
        engine.add_request(prompt(9, 4), SamplingParams(temperature=1.0, max_tokens=5))  # noise
        run(engine)
        return [m.output_token_ids for m in samples_of(seq)]

    first, second = outputs(), outputs()
    assert first == second
    assert len({tuple(o) for o in first}) == 4, "the samples must differ"
    # sample i of seed s is the single request seeded sample_seed(s, i), after its first token
    engine = make_engine(tiny_llama)
    alone = engine.add_request(
        prompt(17, 3), dataclasses.replace(params, n=1, seed=sample_seed(7, 2))
    )
    run(engine)
    assert alone.output_token_ids == first[2]


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_group_preempted_as_one_gives_the_same_outputs(
    tiny_llama: Path, mode: PreemptionMode
) -> None:
    prompts = [prompt(30 + 7 * i, 10 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, n=3)

    assert_same_under_pressure(tiny_llama, prompts, params, num_blocks=90, preemption_mode=mode)


def test_abort_ends_every_sample_and_frees_every_block(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    seq = engine.add_request(prompt(21, 5), SamplingParams(temperature=1.0, max_tokens=50, n=5))
    other = engine.add_request(prompt(8, 6), SamplingParams(temperature=0.0, max_tokens=20))
    for _ in range(4):
        engine.step()
    assert len(samples_of(seq)) == 5
    assert engine.abort(seq.request_id)
    assert all(m.finish_reason is FinishReason.ABORT for m in samples_of(seq))
    assert not engine.abort(seq.request_id)
    engine.check_integrity()
    run(engine)
    assert other.finish_reason is FinishReason.LENGTH


def test_a_group_that_cannot_fit_fails_alone(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, num_blocks=40)
    # one sample needs 16 blocks; eight need 8 + 8 x 8 = 72 > 40
    seq = engine.add_request(prompt(32, 7), SamplingParams(temperature=0.0, max_tokens=32, n=8))
    assert seq.finish_reason is FinishReason.ERROR
    assert engine.step().finished == [seq]
    assert "per sample" in engine.errors[seq.request_id]
    run(engine)


def test_swapping_a_group_moves_each_shared_block_once(tiny_llama: Path) -> None:
    """A higher-priority request displaces a group of 4 samples: the prompt's blocks (held by
    the 4 samples only) go to the host once and come back as one device block each."""
    group_params = SamplingParams(temperature=0.0, max_tokens=24, n=4)
    urgent_params = SamplingParams(temperature=0.0, max_tokens=8)
    group_prompt, urgent_prompt = prompt(40, 20), prompt(180, 21)

    def outputs(**overrides) -> tuple[list[list[int]], list[int], list]:
        engine = make_engine(tiny_llama, min_priority_gap=1, **overrides)
        seq = engine.add_request(group_prompt, group_params, priority=5)
        for _ in range(3):
            engine.step()
        urgent = engine.add_request(urgent_prompt, urgent_params, priority=0)
        swap_outs = []
        while engine.has_unfinished:
            out = engine.step()
            engine.check_integrity()
            if out.plan.swap_out:
                space = engine.swap_space
                assert space is not None
                swap_outs.append(
                    (list(out.plan.swap_out), space.pool.num_used, space.pool.num_refs)
                )
        run(engine)
        return [m.output_token_ids for m in samples_of(seq)], urgent.output_token_ids, swap_outs

    want_group, want_urgent, none = outputs()
    assert none == []
    got_group, got_urgent, swap_outs = outputs(
        num_blocks=60, num_swap_blocks=40, preemption_mode=PreemptionMode.SWAP
    )
    assert (got_group, got_urgent) == (want_group, want_urgent)
    assert swap_outs, "the group must have been swapped out"
    pairs, host_used, host_refs = swap_outs[0]
    prompt_blocks = 40 // BLOCK_SIZE
    assert len({d for d, _ in pairs}) == len(pairs), "a device block was copied twice"
    assert host_used == len(pairs)
    # 10 prompt blocks held by 4 records each, + one own block per sample
    assert len(pairs) == prompt_blocks + 4
    assert host_refs == 4 * prompt_blocks + 4


@pytest.mark.parametrize(("k", "length_penalty"), [(2, 1.0), (4, 1.0), (4, 0.5)])
def test_beam_search_equals_transformers(tiny_llama: Path, k: int, length_penalty: float) -> None:
    prompts = [prompt(n, 30 + n) for n in (7, 19, 33)]
    new = 24
    params = SamplingParams(
        temperature=0.0, max_tokens=new, use_beam_search=True, beam_width=k, n=2,
        length_penalty=length_penalty,
    )  # fmt: skip
    engine = make_engine(tiny_llama)
    seqs = [engine.add_request(p, params) for p in prompts]
    run(engine)
    differs = False
    for p, seq in zip(prompts, seqs, strict=True):
        want = hf_beams(tiny_llama, p, k, new, length_penalty, 2)
        got = [m.output_token_ids for m in samples_of(seq)[:2]]
        assert got == want, f"prompt of {len(p)} tokens"
        greedy, _ = hf_greedy(tiny_llama, torch.float32, tuple(p))
        differs |= got[0] != greedy[:new]
    assert differs, "beam search must find something greedy does not (else the test is weak)"


@pytest.mark.parametrize("k", [2, 4])
def test_beams_that_end_early_equal_transformers(tiny_llama: Path, k: int) -> None:
    """Stop ids that the beams hit: finished hypotheses, shorter outputs, the early stop."""
    new = 24
    for n in (9, 21, 40):
        tokens = prompt(n, 50 + n)
        greedy, _ = hf_greedy(tiny_llama, torch.float32, tuple(tokens))
        stop = (greedy[2], greedy[5])  # NOTE: likely continuations: beams will end on them
        params = SamplingParams(
            temperature=0.0, max_tokens=new, use_beam_search=True, beam_width=k, n=k,
            stop_token_ids=stop,
        )  # fmt: skip
        engine = make_engine(tiny_llama)
        seq = engine.add_request(tokens, params)
        run(engine)
        got = [m.output_token_ids for m in samples_of(seq)]
        want = hf_beams(tiny_llama, tokens, k, new, 1.0, k, stop)
        assert got == want, f"prompt of {n} tokens"
        assert any(len(g) < new for g in got), "some beam must have ended on a stop id"


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_beam_search_under_preemption_gives_the_same_beams(tiny_llama: Path, mode) -> None:
    prompts = [prompt(26 + 9 * i, 70 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, use_beam_search=True, beam_width=3, n=3)

    assert_same_under_pressure(tiny_llama, prompts, params, num_blocks=80, preemption_mode=mode)


def test_the_decode_worker_stops_one_sample_and_streams_the_others(tiny_llama: Path) -> None:
    """`Abort("<request>#<i>")` (what the router sends when sample i's stop string matched)
    ends that sample alone, sample 0 included; the others go on. Steps driven by hand."""
    import time

    from pagedserve.decode_worker.convert import DecodeCall
    from pagedserve.decode_worker.worker import DecodeWorker

    engine = make_engine(tiny_llama, block_size=16, num_blocks=64)
    worker = DecodeWorker(engine)  # NOTE: its loop is not started: `step()` by hand
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, n=3, ignore_eos=True)
        samples = ((7, None), (7, None), (7, None))
        call = DecodeCall("req", prompt(20, 90), params, 0, "", 7, None, None, samples=samples)
        stream = worker.submit(call)
        deadline = time.monotonic() + 30
        while worker._tracked["req"].importing:
            assert time.monotonic() < deadline, "the import never ended"
            time.sleep(0.01)
        for _ in range(4):
            worker.step()
        assert worker.abort("req#2")
        assert not worker.abort("req#2")
        for _ in range(3):
            worker.step()
        assert worker.abort("req#0")
        while worker.num_in_flight:
            worker.step()
        assert not worker.abort("req#1")
        ends: dict[int, FinishReason] = {}
        made: dict[int, int] = {0: 0, 1: 0, 2: 0}
        while len(ends) < 3:
            delta = stream.get(5.0)
            assert delta is not None, "stream stalled"
            made[delta.index] += len(delta.token_ids)
            if delta.finish_reason is not None:
                ends[delta.index] = delta.finish_reason
        assert ends == {0: FinishReason.ABORT, 1: FinishReason.LENGTH, 2: FinishReason.ABORT}
        assert (made[0], made[1], made[2]) == (7, 39, 4)  # NOTE: the first token is the caller's
    finally:
        worker.close()
    engine.check_integrity()
    assert engine.pool.num_used == 0
