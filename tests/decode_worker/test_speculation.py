"""Speculative decoding (n-gram prompt lookup): proposals, rollback of rejected slots, and
greedy output equal to transformers' with speculation on, in mixed batches and under swap."""

from __future__ import annotations

import pytest
import torch
from support.oracle import GREEDY, hf_greedy, make_engine, make_prompts

from pagedserve.decode_worker.plan import KVPolicy, PreemptionMode
from pagedserve.decode_worker.speculation import (
    SpeculativeConfig,
    SpeculativeMethod,
    Speculator,
    eligible,
    ngram_proposal,
)
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.model.requests.sequence import make_sequence
from pagedserve.model.runner import accept_greedy
from pagedserve.model.sampler import Sampler, SamplingRow
from pagedserve.sampling_params import SamplingParams

NGRAM = SpeculativeConfig(num_tokens=4)


def test_ngram_proposal_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 8, 7, 5, 2, 3, 6, 1, 2, 3]
    # "1 2 3" recurs at 0: its continuation, not the shorter "2 3" at 7 (followed by 6)
    assert ngram_proposal(tokens, 1, 4, 3) == [9, 8, 7]
    assert ngram_proposal(tokens, 1, 2, 3) == [6, 1, 2]  # "2 3" last seen at 7
    assert ngram_proposal(tokens, 1, 4, 9) == tokens[3:12]
    assert ngram_proposal([1, 2, 3, 4], 1, 4, 3) == []  # nothing recurs
    assert ngram_proposal([4, 4], 1, 4, 3) == [4]  # the suffix itself is never its own match
    # a periodic run: the latest occurrence with k tokens after it, not the one just before
    assert ngram_proposal([1, 2, 3] * 4, 1, 4, 6) == [1, 2, 3, 1, 2, 3]
    assert ngram_proposal([7], 1, 4, 3) == []


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # d_2 = 6 rejected: 9 instead
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]  # none accepted


def test_truncate_frees_the_blocks_past_the_kept_tokens_and_never_a_cached_one():
    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    table.append_slots(13)  # 4 blocks
    pool.cache_block(table.block_ids[0], BlockHash(bytes(16)), depth=0)
    table.num_cached_blocks = 1
    kept = table.block_ids[:2]
    table.truncate(6)
    pool.check_integrity()
    assert (table.block_ids, table.num_tokens, pool.num_free) == (kept, 6, 6)
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(0)  # would drop the cached block 0
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(7)  # more than it holds
    table.free()
    pool.check_integrity()


def test_only_sequences_whose_sampler_takes_the_raw_argmax_speculate(tiny_llama):
    engine = make_engine(tiny_llama, speculative=NGRAM)

    def seq(**params):
        return make_sequence(engine.model_config, 64, engine.pool, b"f", "r", [1, 2],
                             SamplingParams(**{"temperature": 0.0, **params}))  # fmt: skip

    assert eligible(seq())
    assert eligible(seq(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=1))
    for params in ({"logprobs": 2}, {"repetition_penalty": 1.1}, {"logit_bias": ((3, 1.0),)},
                   {"min_tokens": 4}, {"use_beam_search": True, "n": 2},
                   {"speculative": False}):  # fmt: skip
        assert not eligible(seq(**params)), params
    engine.close()


def test_adaptive_k_shrinks_for_a_sequence_whose_proposals_are_rejected(tiny_llama):
    engine = make_engine(tiny_llama)
    speculator = Speculator(SpeculativeConfig(num_tokens=8))
    seq = make_sequence(engine.model_config, 64, engine.pool, b"f", "r", [1, 2, 3] * 6, GREEDY)
    assert len(speculator.propose(seq, 16)) == 8
    for _ in range(6):
        speculator.observe(seq, 8, 0)
    assert len(speculator.propose(seq, 16)) == 1  # never 0: a sequence may start to repeat
    assert len(speculator.propose(seq, 0)) == 0  # no room left (max_tokens)
    assert speculator.stats.num_draft_tokens == 48 and speculator.stats.acceptance_rate == 0
    engine.close()


def _run(model_dir, prompts, params, **config):
    paged = config.get("kv_policy", KVPolicy.PAGED) is KVPolicy.PAGED
    engine = make_engine(model_dir, **config)
    engine.record_logits = True
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    swapped = 0
    while engine.has_unfinished:
        swapped += len(engine.step().plan.preempted)
        engine.check_integrity()
        for entry in engine.scheduler.running:  # NOTE: no slot of a rejected proposal is kept
            seq = entry.seq
            worst = seq.num_prompt_tokens + seq.params.max_tokens
            assert seq.block_table.num_tokens == (seq.num_computed_tokens if paged else worst)
    stats = engine.speculation_stats
    logits = {s.request_id: engine.logits.get(s.request_id, []) for s in seqs}
    engine.close()
    return seqs, stats, logits, swapped


@pytest.mark.parametrize(
    ("num_blocks", "mode"),
    [(400, PreemptionMode.SWAP), (46, PreemptionMode.SWAP), (46, PreemptionMode.RECOMPUTE)],
    ids=["roomy", "swapping", "recomputing"],
)
def test_speculation_keeps_transformers_tokens_and_logits(tiny_llama, num_blocks, mode):
    """Eight prompts of mixed lengths, blocks of 8; with 46 blocks (the longest prompt alone
    takes 42) the pool runs short, so sequences are swapped out and in (or recomputed) while
    they speculate."""
    prompts = make_prompts()
    seqs, stats, logits, swapped = _run(
        tiny_llama, prompts, [GREEDY] * len(prompts), block_size=8, num_blocks=num_blocks,
        num_swap_blocks=64, max_num_batched_tokens=64, preemption_mode=mode,
        speculative=NGRAM,
    )  # fmt: skip
    print(f"speculation: {stats}, {mode.value} preemptions: {swapped}")
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert swapped >= (num_blocks < 100)
    for prompt, seq in zip(prompts, seqs, strict=True):
        tokens, ref_logits = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
        assert seq.output_token_ids == tokens
        got = torch.stack(logits[seq.request_id])
        assert torch.allclose(got, ref_logits, atol=1e-4, rtol=0)


def test_speculation_changes_no_token_of_stopped_short_or_ineligible_requests(tiny_llama):
    """A batch of greedy requests (stop token ids, max_tokens 1 .. 20) beside seeded sampled
    ones that do not speculate (a penalty, logprobs): every request's tokens equal the run
    without speculation; the greedy ones speculate."""
    prompts = make_prompts((5, 40, 12, 70, 9, 33))
    ref = _run(tiny_llama, prompts, [GREEDY] * len(prompts), block_size=8, num_blocks=200)[0]
    stop_at = ref[1].output_token_ids[9]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=(stop_at,)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=24, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    off = _run(tiny_llama, prompts, params, block_size=8, num_blocks=200)[0]
    on, stats, _, _ = _run(tiny_llama, prompts, params, block_size=8, num_blocks=200,
                           speculative=NGRAM)  # fmt: skip
    assert stats.num_accepted_tokens > 0
    for a, b, p in zip(off, on, params, strict=True):
        assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason)
        assert b.num_output_tokens <= p.max_tokens
    assert on[1].output_token_ids[-1] == stop_at and len(on[1].output_token_ids) <= 10


def test_a_reserve_max_reservation_survives_rejected_proposals(tiny_llama):
    prompts = make_prompts((5, 40, 12))
    seqs, stats, _, _ = _run(tiny_llama, prompts, [GREEDY] * 3, block_size=8, num_blocks=200,
                             kv_policy=KVPolicy.RESERVE_MAX, speculative=NGRAM)  # fmt: skip
    assert stats.num_accepted_tokens > 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]


def test_no_proposals_while_the_batch_is_larger_than_max_batch(tiny_llama):
    prompts = make_prompts((5, 9, 12, 20))
    _, stats, _, _ = _run(tiny_llama, prompts, [GREEDY] * 4, block_size=8, num_blocks=200,
                          speculative=SpeculativeConfig(num_tokens=4, max_batch=3))  # fmt: skip
    # NOTE: all four run together until the first finishes (same max_tokens: never)
    assert stats.num_draft_tokens == 0


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution a row samples from, computed here independently of the sampler."""
    scaled = logits / temperature
    kth = scaled.topk(top_k).values[-1]
    return scaled.masked_fill(scaled < kth, float("-inf")).softmax(-1)


def _chi_square(observed: list[int], expected: torch.Tensor) -> float:
    total = sum(observed)
    kept = expected > 0
    assert all(n == 0 for n, e in zip(observed, expected.tolist(), strict=True) if e == 0)
    obs = torch.tensor(observed, dtype=torch.float64)[kept]
    exp = expected.double()[kept] * total
    return float(((obs - exp) ** 2 / exp).sum())


def test_rejection_sampling_keeps_the_target_distribution_of_every_emitted_token():
    """A six-token vocabulary, top-k 4 at temperature 0.8, two proposals: over 12,000 seeded
    verifications the first emitted token follows the first row's distribution and, after the
    first proposal is accepted, the second follows the second row's (chi-square, 3 degrees of
    freedom, below the 0.999 quantile 16.27)."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, seed=11)
    p0, p1 = _target(logits[0], 0.8, 4), _target(logits[1], 0.8, 4)
    draft = [int(p0.argsort(descending=True)[1]), int(p1.argsort(descending=True)[0])]
    sampler = Sampler()
    row = SamplingRow("r", params, [1], [])
    first, second = [0] * 6, [0] * 6
    for _ in range(12_000):
        emitted = sampler.verify_draft(logits, row, draft)
        assert 1 <= len(emitted) <= 3 and emitted[: len(emitted) - 1] == draft[: len(emitted) - 1]
        first[emitted[0]] += 1
        if emitted[0] == draft[0]:
            second[emitted[1]] += 1
    assert _chi_square(first, p0) < 16.27, (first, p0)
    assert _chi_square(second, p1) < 16.27, (second, p1)
    assert 1_000 < sum(second) < 11_000  # both outcomes of the first proposal were seen


def test_seeded_sampled_requests_speculate_and_reproduce(tiny_llama):
    prompts = make_prompts((9, 40, 70))
    # NOTE: a peaked distribution, so that some proposals are accepted on the tiny random model
    # (at 0.3 these seeds' draws took 0 of 26 proposed tokens; at 0.1, 9 of 32)
    params = [SamplingParams(temperature=0.1, top_p=0.9, seed=s, max_tokens=24) for s in (1, 2, 3)]
    runs = [_run(tiny_llama, prompts, params, block_size=8, num_blocks=200, speculative=NGRAM)
            for _ in range(2)]  # fmt: skip
    (first, stats, _, _), (again, _, _, _) = runs
    assert stats.num_accepted_tokens > 0
    assert [s.output_token_ids for s in first] == [s.output_token_ids for s in again]
    assert all(s.num_output_tokens == 24 or s.finish_reason.value == "stop" for s in first)


@pytest.fixture(scope="module")
def tiny_draft(make_tiny):
    """A one-layer draft of other random weights, the tiny model's vocabulary."""
    return make_tiny("llama", layers=1, seed=5)


def _draft(model_dir) -> SpeculativeConfig:
    return SpeculativeConfig(SpeculativeMethod.DRAFT, num_tokens=4, draft_model=str(model_dir))


@pytest.mark.parametrize("num_blocks", [400, 46], ids=["roomy", "swapping"])
def test_the_target_as_its_own_draft_is_accepted_every_time(tiny_llama, num_blocks):
    """The draft's KV shares the target's blocks; it is valid exactly where the bookkeeping says
    (reset when a sequence is swapped out): with the target's own weights as the draft, nearly
    every proposal is accepted, under swap preemption too, and every token is transformers'."""
    prompts = make_prompts()
    seqs, stats, _, swapped = _run(
        tiny_llama, prompts, [GREEDY] * len(prompts), block_size=8, num_blocks=num_blocks,
        num_swap_blocks=64, max_num_batched_tokens=64, preemption_mode=PreemptionMode.SWAP,
        speculative=_draft(tiny_llama),
    )  # fmt: skip
    print(f"self-draft: {stats}, swap preemptions: {swapped}")
    assert swapped >= (num_blocks < 100)
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate > 0.95
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]


def test_another_draft_changes_no_token(tiny_llama, tiny_draft):
    prompts = make_prompts((3, 30, 70))
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=5)]
    seqs, stats, _, _ = _run(tiny_llama, prompts, params, block_size=8, num_blocks=200,
                             speculative=_draft(tiny_draft))  # fmt: skip
    assert stats.num_draft_tokens > 0
    for prompt, seq, p in zip(prompts, seqs, params, strict=True):
        want = hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0][: p.max_tokens]
        assert seq.output_token_ids == want


def test_a_draft_of_another_vocabulary_is_refused_naming_the_flag(tiny_llama, make_tiny):
    other = make_tiny("llama", vocab=640)
    with pytest.raises(ValueError, match="speculative-model: the draft's vocabulary"):
        make_engine(tiny_llama, speculative=_draft(other))
    with pytest.raises(ValueError, match="speculative-model: a draft model directory"):
        SpeculativeConfig(SpeculativeMethod.DRAFT)


def test_the_samples_of_a_request_speculate_each_and_reproduce(tiny_llama):
    """n = 3 seeded samples fork after the first token; each then speculates on its own (its
    proposals from its own tokens) and the request's outputs reproduce run after run."""
    params = SamplingParams(temperature=0.3, seed=7, n=3, max_tokens=24)
    outputs = []
    for _ in range(2):
        engine = make_engine(tiny_llama, block_size=8, num_blocks=200, speculative=NGRAM)
        seq = engine.add_request(make_prompts((40,))[0], params)
        while engine.has_unfinished:
            engine.step()
            engine.check_integrity()
        assert seq.group is not None
        members = seq.group.members
        assert all(m.num_draft_tokens > 0 for m in members), "every sample speculates"
        outputs.append([m.output_token_ids for m in members])
        engine.close()
    assert outputs[0] == outputs[1] and len({tuple(o) for o in outputs[0]}) > 1
