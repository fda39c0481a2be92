"""Sampler: greedy, penalties and filters against transformers' processors, seeds, logprobs."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Sequence
from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedserve.model import sampler as sampler_module
from pagedserve.model.sampler import (
    DRAW_BLOCK,
    Sampler,
    SamplingRow,
    draw_rows,
    greedy_tokens,
)
from pagedserve.sampling_params import SamplingParams

VOCAB = 50
GREEDY = SamplingParams(temperature=0.0)
# transformers' warpers ignore input_ids; they only need the argument.
NO_IDS = cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.long))
ROW_IDS = itertools.count()


def make_row(
    params: SamplingParams = GREEDY,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    seed: int | None = None,
    eos: tuple[int, ...] = (),
) -> SamplingRow:
    """A row of its own request (a fresh id), seeded with `seed` (None: the global RNG)."""
    params = dataclasses.replace(params, seed=seed)
    return SamplingRow(f"row-{next(ROW_IDS)}", params, list(prompt), list(output), eos)


def random_logits(batch: int = 1, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_tokens_equal_argmax_on_ties_nan_and_infinite_rows() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (8, 1000), generator=g).float()  # many tied maxima per row
    logits[1, [5, 700]] = float("nan")
    logits[2] = float("-inf")
    logits[3, [0, 999]] = float("inf")
    for rows in (logits, logits.to(torch.bfloat16), logits[:, :7]):
        assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1))
    assert greedy_tokens(logits)[:4].tolist() == [int(logits[0].eq(2).nonzero()[0]), 5, 0, 0]


def test_draws_follow_the_weights_and_never_take_a_zero_weight_token() -> None:
    weights = torch.tensor([5.0, 2.5, 1.5, 1.0, 0.0]).repeat(20_000, 1)  # unnormalized
    uniforms = torch.rand(20_000, generator=torch.Generator().manual_seed(0))
    share = torch.bincount(draw_rows(weights, uniforms), minlength=5).float() / 20_000
    assert share[4] == 0
    torch.testing.assert_close(share[:4], torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=0.015, rtol=0)
    # the ends: u = 0 takes the first token of positive weight, u = 1 (rounding) the last one
    edge = torch.tensor([[0.0, 0.3, 0.7, 0.0]] * 2)
    assert draw_rows(edge, torch.tensor([0.0, 1.0])).tolist() == [1, 2]


def test_draws_over_blocks_of_tokens_invert_the_running_sum() -> None:
    """draw_rows sums blocks of DRAW_BLOCK tokens, then runs through one: the same token as a
    float64 running sum over the whole row, across whole and partial blocks, zero-weight
    tokens and a zero-weight block, and at both ends."""
    g = torch.Generator().manual_seed(3)
    vocab = 3 * DRAW_BLOCK + 37
    weights = torch.rand(4, vocab, generator=g) ** 4
    weights[:, :5] = 0  # zeros first
    weights[:, DRAW_BLOCK : 2 * DRAW_BLOCK] = 0  # a whole block
    weights[:, -3:] = 0  # and last, in the partial block
    weights[1, : 3 * DRAW_BLOCK] = 0  # a row whose weight is all in the partial block
    rows = weights.repeat(500, 1)
    uniforms = torch.rand(len(rows), generator=g)
    uniforms[:4], uniforms[4:8] = 0.0, 1.0
    cumulative = rows.double().cumsum(dim=-1)
    want = torch.searchsorted(
        cumulative, uniforms.double()[:, None] * cumulative[:, -1:], right=True
    )
    want = torch.where(want.squeeze(1) >= vocab, vocab - 4, want.squeeze(1))  # u = 1: the last
    got = draw_rows(rows, uniforms)
    assert torch.equal(got, want)
    assert (rows.gather(1, got[:, None]) > 0).all()
    assert got[:4].tolist() == [5, 3 * DRAW_BLOCK, 5, 5]


@pytest.mark.parametrize(("temperature", "dtype"), [(1.0, torch.float32), (0.2, torch.float64)])
def test_cold_rows_draw_from_float64_probabilities(temperature, dtype, monkeypatch) -> None:
    """Below COLD_TEMPERATURE the probabilities reach float32's denormals (slow), so a block
    with a cold row draws from float64 ones; never a banned token either way."""
    seen: list[torch.dtype] = []
    original = sampler_module.draw_rows
    monkeypatch.setattr(
        sampler_module, "draw_rows", lambda w, u: seen.append(w.dtype) or original(w, u)
    )
    logits = random_logits(batch=2, vocab=500, seed=9) * 10  # spans ~200 / temperature
    params = SamplingParams(temperature=temperature, bad_word_ids=((7,),), top_p=0.999)
    rows = [make_row(params, seed=1), make_row(SamplingParams(temperature=1.0), seed=2)]
    banned = logits.clone()
    banned[0, 7] = 1e4  # the most likely token, yet banned
    for _ in range(20):
        assert Sampler()(banned, rows).token_ids[0] != 7
    assert set(seen) == {dtype}


def test_greedy_takes_argmax_per_row() -> None:
    logits = random_logits(batch=4)
    out = Sampler()(logits, [make_row() for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 4


def test_greedy_ties_take_the_lowest_index() -> None:
    logits = torch.zeros(2, 8)
    logits[0, [2, 5]] = 1.0
    logits[1, [7, 3]] = 1.0
    assert Sampler()(logits, [make_row(), make_row()]).token_ids == [2, 3]


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    logits = random_logits(batch=1)
    row, sampler = make_row(SamplingParams(temperature=5.0, top_k=1), seed=0), Sampler()
    for _ in range(20):
        assert sampler(logits, [row]).token_ids == [int(logits.argmax())]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype_is_accepted(dtype: torch.dtype) -> None:
    logits = random_logits(batch=2).to(dtype)
    out = Sampler()(logits, [make_row(), make_row()])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_batch_size_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler()(random_logits(batch=2), [make_row()])


def test_logits_are_not_mutated() -> None:
    logits = random_logits(batch=1)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, top_k=3, min_tokens=2)
    Sampler()(logits, [make_row(params, prompt=[1, 2], output=[3], seed=0, eos=(4,))])
    assert torch.equal(logits, before)


# --- penalties --------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    logits = random_logits(batch=1)
    prompt, output = [1, 4, 4, 9, 17], [9, 23, 30]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    ours = Sampler().processed_logits(logits, [make_row(params, prompt=prompt, output=output)])
    input_ids = cast(torch.LongTensor, torch.tensor([prompt + output]))
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_subtract_exactly() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = make_row(params, prompt=[0, 0, 5], output=[1, 1, 1, 2])
    ours = Sampler().processed_logits(logits, [row])
    # token 1: 3 x 0.5 + 0.25; token 2: 1 x 0.5 + 0.25; prompt-only tokens 0 and 5 untouched.
    assert ours[0].tolist() == [0.0, -1.75, -0.75, 0.0, 0.0, 0.0]


def test_negative_presence_penalty_rewards_seen_tokens() -> None:
    logits = torch.zeros(1, 4)
    row = make_row(SamplingParams(temperature=0.0, presence_penalty=-1.0), output=[3])
    assert Sampler()(logits, [row]).token_ids == [3]


def test_min_tokens_suppresses_eos_and_stop_ids_then_stops_suppressing() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0  # eos
    logits[0, 5] = 9.0  # stop id
    logits[0, 6] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    sampler = Sampler()
    early = [make_row(params, output=out, eos=(2,)) for out in ([], [6])]
    assert [sampler(logits, [row]).token_ids[0] for row in early] == [6, 6]
    assert sampler(logits, [make_row(params, output=[6, 6], eos=(2,))]).token_ids == [2]


def test_min_tokens_with_ignore_eos_leaves_eos_alone() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 10.0
    logits[0, 5] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,), ignore_eos=True)
    assert Sampler()(logits, [make_row(params, eos=(2,))]).token_ids == [2]
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(2,), ignore_eos=True)
    assert Sampler()(logits, [make_row(params, eos=(2,))]).token_ids == [5]


# --- filters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [2, 5, 17, 49])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_keeps_the_set_transformers_keeps(top_k: int, seed: int) -> None:
    logits = random_logits(seed=seed)
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(top_k=top_k))])
    expected = TopKLogitsWarper(top_k)(NO_IDS, logits.clone())
    assert kept(ours) == kept(expected)
    assert len(kept(ours)) == top_k


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 10])
def test_top_k_off_or_beyond_vocab_keeps_everything(top_k: int) -> None:
    logits = random_logits()
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(top_k=top_k))])
    assert len(kept(ours)) == VOCAB


def test_top_k_of_a_mixed_block_equals_transformers_row_by_row() -> None:
    """The scatter of the k largest and the comparison it falls back to (ties at the k-th, rows
    without a top-k, rows a grammar left fewer than k tokens) give transformers' rows."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 300, generator=g) * 3
    logits[1] = torch.randint(0, 4, (300,), generator=g).float()  # ties everywhere
    logits[2, 40:] = float("-inf")  # 40 tokens allowed, k = 64
    logits[3, :] = float("-inf")
    logits[3, 7] = 1.0
    ks = [40, 3, 64, 5, 0, 299, 1]
    got = sampler_module.apply_top_k(logits, ks)
    assert got is not logits
    for row, k in enumerate(ks):
        want = logits[row : row + 1].clone()
        if 0 < k < 300:
            want = TopKLogitsWarper(k)(NO_IDS, want)
        assert torch.equal(got[row : row + 1], want), row


def test_top_k_keeps_ties_with_the_kth_value_like_transformers() -> None:
    logits = torch.tensor([[5.0, 1.0, 3.0, 3.0, 0.0]])
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(top_k=2))])
    assert kept(ours) == {0, 2, 3}


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_keeps_the_set_transformers_keeps(top_p: float, seed: int) -> None:
    logits = random_logits(seed=seed)
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(top_p=top_p))])
    expected = TopPLogitsWarper(top_p)(NO_IDS, logits.clone())
    assert kept(ours) == kept(expected)
    assert len(kept(ours)) >= 1


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_over_a_large_vocabulary_keeps_the_set_transformers_keeps(top_p: float) -> None:
    """Rows decided from their 256 most likely tokens, from 4,096, and from the whole sorted
    row (apply_top_p's three steps), in one batch and each alone."""
    g = torch.Generator().manual_seed(11)
    scales = torch.tensor([[8.0], [2.0], [1.0], [0.05]])  # peaked ... nearly flat
    logits = torch.randn(4, 6000, generator=g) * scales
    rows = [make_row(SamplingParams(top_p=top_p)) for _ in range(4)]
    ours = Sampler().processed_logits(logits, rows)
    sizes = []
    for i in range(4):
        expected = TopPLogitsWarper(top_p)(NO_IDS, logits[i : i + 1].clone())
        assert kept(ours[i : i + 1]) == kept(expected)
        alone = Sampler().processed_logits(logits[i : i + 1], [rows[i]])
        assert torch.equal(alone, ours[i : i + 1])
        sizes.append(len(kept(expected)))
    if top_p == 0.9:  # each of the three steps decides a row
        assert sizes[0] < 256 and any(256 < n < 4096 for n in sizes) and sizes[3] > 4096


@pytest.mark.parametrize("top_p", [0.9, 0.95, 0.99, 0.999])
def test_top_p_over_a_49152_token_vocabulary_keeps_transformers_set(top_p: float) -> None:
    """Zipf-like rows the size of SmolLM2's vocabulary: float32 softmax's rows sum to 1 only
    within ~1e-5 there, and a head's mass not taken over its row's own total kept another
    boundary token than transformers' in some of these rows."""
    g = torch.Generator().manual_seed(5)
    vocab = 49152
    zipf = -torch.arange(1, vocab + 1).float().log()
    logits = torch.stack(
        [zipf[torch.randperm(vocab, generator=g)] + 0.3 * torch.randn(vocab, generator=g)
         for _ in range(32)]
    )  # fmt: skip
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(top_p=top_p))] * 32)
    expected = TopPLogitsWarper(top_p)(NO_IDS, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))


@pytest.mark.parametrize("seed", range(5))
def test_tiny_top_p_keeps_only_the_most_likely_token(seed: int) -> None:
    logits = random_logits(seed=seed)
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(top_p=1e-9))])
    assert kept(ours) == {int(logits.argmax())}


def test_top_p_of_one_keeps_tokens_whose_probability_underflows() -> None:
    logits = torch.tensor([[0.0, -200.0, -1.0], [0.0, -200.0, -1.0]])
    rows = [make_row(SamplingParams(top_p=0.5)), make_row(SamplingParams(top_p=1.0))]
    ours = Sampler().processed_logits(logits, rows)
    assert kept(ours[1:]) == {0, 1, 2}


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_keeps_the_set_transformers_keeps(min_p: float, seed: int) -> None:
    logits = random_logits(seed=seed)
    ours = Sampler().processed_logits(logits, [make_row(SamplingParams(min_p=min_p))])
    expected = MinPLogitsWarper(min_p)(NO_IDS, logits.clone())
    assert kept(ours) == kept(expected)


def test_filters_compose_in_transformers_order() -> None:
    logits = random_logits(seed=7)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05)
    ours = Sampler().processed_logits(logits, [make_row(params)])
    expected = logits / 0.7
    for warper in (TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        expected = warper(NO_IDS, expected)
    assert kept(ours) == kept(expected)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(ours[finite], expected[finite])


def test_rows_in_one_batch_are_filtered_independently() -> None:
    logits = random_logits(batch=4, seed=3)
    params = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(),
    ]
    batched = Sampler().processed_logits(logits, [make_row(p) for p in params])
    for i, p in enumerate(params):
        alone = Sampler().processed_logits(logits[i : i + 1], [make_row(p)])
        assert torch.equal(batched[i : i + 1], alone)
    assert torch.isfinite(batched[3]).all()


def test_sampled_tokens_stay_within_top_k() -> None:
    logits = random_logits(seed=4)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    row, sampler = make_row(SamplingParams(temperature=1.5, top_k=3), seed=123), Sampler()
    draws = Counter(sampler(logits, [row]).token_ids[0] for _ in range(200))
    assert set(draws) <= allowed
    assert len(draws) >= 2  # it does sample, not argmax


# --- seeds and temperature ---------------------------------------------------------------------


def generate(rows: list[SamplingRow], steps: int, seed: int = 0) -> list[list[int]]:
    """Sample `steps` tokens for every row with fresh random logits per step."""
    return generate_with(Sampler(), rows, steps, seed)


def generate_with(
    sampler: Sampler, rows: list[SamplingRow], steps: int, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    tokens: list[list[int]] = [[] for _ in rows]
    base = torch.randn(steps, VOCAB, generator=g)
    for step in range(steps):
        logits = base[step].expand(len(rows), VOCAB).contiguous()
        for i, token in enumerate(sampler(logits, rows).token_ids):
            tokens[i].append(token)
    return tokens


def test_seeded_row_gives_same_tokens_whatever_else_is_batched() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = generate([make_row(params, seed=42)], steps=12)[0]
    others = [
        make_row(SamplingParams(temperature=0.8), seed=None),
        make_row(SamplingParams(temperature=1.3, top_k=5, seed=7), seed=7),
        make_row(GREEDY),
    ]
    batched = generate([others[0], make_row(params, seed=42), *others[1:]], steps=12)[1]
    torch.manual_seed(999)  # the global RNG must not matter either
    again = generate([make_row(params, seed=42), others[1]], steps=12)[0]
    assert alone == batched == again
    assert len(set(alone)) > 1


def test_different_seeds_give_different_tokens() -> None:
    params = SamplingParams(temperature=1.0)
    a, b = generate([make_row(params, seed=1), make_row(params, seed=2)], steps=16)
    assert a != b


def test_the_sampler_keeps_a_generator_per_request_until_it_is_removed() -> None:
    params = SamplingParams(temperature=1.0)
    row = make_row(params, seed=42)
    sampler = Sampler()
    first = generate_with(sampler, [row], steps=8)[0]
    assert sampler.num_generators == 1
    assert generate_with(sampler, [row], steps=8)[0] != first, "the generator went on"
    sampler.remove(row.request_id)
    assert sampler.num_generators == 0
    assert generate_with(sampler, [row], steps=8)[0] == first, "a new request starts over"
    greedy = make_row(GREEDY, seed=42)
    generate_with(sampler, [greedy], steps=1)
    assert sampler.num_generators == 1, "a greedy row draws nothing: no generator"


def test_restore_undoes_the_draws_since_save() -> None:
    params = SamplingParams(temperature=1.0)
    used, fresh = make_row(params, seed=5), make_row(params, seed=6)
    sampler = Sampler()
    generate_with(sampler, [used], steps=3)
    states = sampler.save([used.request_id, fresh.request_id])
    once = generate_with(sampler, [used, fresh], steps=4)
    sampler.restore(states)
    assert generate_with(sampler, [used, fresh], steps=4) == once


def test_high_temperature_flattens_the_distribution() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 0] = 4.0
    sampler = Sampler()

    def share_of_top(temperature: float) -> float:
        row = make_row(SamplingParams(temperature=temperature), seed=5)
        draws = [sampler(logits, [row]).token_ids[0] for _ in range(1000)]
        return draws.count(0) / len(draws)

    # p(top) = e^4 / (e^4 + 9) = 0.86 at T=1; ~0.104 at T=100 (uniform is 0.1).
    assert share_of_top(1.0) > 0.75
    assert share_of_top(100.0) < 0.2


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_logprobs_come_from_raw_logits(num_top: int) -> None:
    logits = random_logits(seed=9)
    # Penalties and temperature change the choice but never the reported logprobs.
    params = SamplingParams(
        temperature=0.5, top_k=4, repetition_penalty=1.7, logprobs=num_top, seed=3
    )
    out = Sampler()(logits, [make_row(params, prompt=[0, 1, 2], seed=3)])
    raw = torch.log_softmax(logits[0], dim=-1)
    lp = out.logprobs[0]
    assert lp is not None
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(raw[lp.token_id].item(), abs=1e-6)
    assert lp.rank == 1 + int((raw > raw[lp.token_id]).sum())
    expected_top = torch.topk(raw, num_top)
    assert [t for t, _ in lp.top] == expected_top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(expected_top.values.tolist(), abs=1e-6)
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_greedy_token_has_rank_one() -> None:
    logits = random_logits(seed=10)
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0.0, logprobs=2))])
    lp = out.logprobs[0]
    assert lp is not None
    assert (lp.rank, lp.top[0][0]) == (1, lp.token_id)


def test_penalised_greedy_choice_reports_its_raw_rank() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=1)
    out = Sampler()(logits, [make_row(params, prompt=[0, 1])])
    lp = out.logprobs[0]
    assert out.token_ids == [2]
    assert lp is not None
    assert (lp.rank, lp.top) == (3, [(0, pytest.approx(torch.log_softmax(logits[0], 0)[0].item()))])


# --- mixed batches ----------------------------------------------------------------------------


def test_batch_of_one_and_mixed_batch_of_eight() -> None:
    logits = random_logits(batch=8, seed=11)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=3),
        SamplingParams(temperature=0.9, top_k=5, seed=1),
        SamplingParams(temperature=1.1, top_p=0.7),
        SamplingParams(min_p=0.2, logprobs=0, seed=2),
        SamplingParams(temperature=0.3, frequency_penalty=1.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(3,)),
        SamplingParams(temperature=2.0, top_k=2, top_p=0.5, min_p=0.5, logprobs=20),
    ]
    rows = [make_row(p, prompt=[1, 2, 3], output=[3, 4], seed=p.seed) for p in params]
    sampler = Sampler()
    out = sampler(logits, rows)
    assert len(out.token_ids) == len(out.logprobs) == 8
    assert out.token_ids[0] == int(logits[0].argmax())
    processed = sampler.processed_logits(logits, rows)
    for i, token in enumerate(out.token_ids):
        assert torch.isfinite(processed[i, token])
        single = sampler(logits[i : i + 1], [rows[i]])
        assert len(single.token_ids) == 1
    assert out.token_ids[6] != 3
    wants = [p.logprobs for p in params]
    for want, lp in zip(wants, out.logprobs, strict=True):
        assert (lp is None) == (want is None)
        if lp is not None:
            assert len(lp.top) == want
