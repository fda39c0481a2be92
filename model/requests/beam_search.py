"""`BeamSearch`: the beam bookkeeping of one request, step for step as Hugging Face does it.

Torch-free: the runner hands each running beam's best continuations (token, logprob) in; this
module decides which beams go on (and from which parent), which hypotheses are finished, and
when the search ends. The scheduler then re-points the beams' block tables (a beam that is
extended shares its parent's blocks; a dropped beam frees what only it held).

One step, as transformers' `_beam_search` (generation/utils.py, v5) with `do_sample=False`::

    candidates  = top (2 + #stop ids - 1) * k of  beam_score[b] + logprob[b][token]
    hits        = candidate ends in a stop id, or reaches max_tokens
    running     = top k of candidates, hits pushed down by -1e9
    finished    = top k of (finished ∪ candidates of rank < k that hit, scored
                  score / generated_len ** length_penalty)
    ends when   no running beam can beat the worst of k finished hypotheses (HF's default
                `early_stopping=False` heuristic), or every candidate hits

Scores are float32 like transformers', so ties and near-ties break the same way: every sum and
quotient is rounded to float32 (`_f32`); a float64 result of one IEEE operation on float32
inputs rounds to the correctly rounded float32 result.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams

_NEG = -1.0e9  # transformers' "impossible" score


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


_NEG32 = _f32(_NEG)


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its generated tokens and its length-normalised score."""

    token_ids: tuple[int, ...]
    score: float
    finished: bool = True


@dataclass(frozen=True, slots=True)
class BeamStep:
    """What a step decided: new beam j continues beam `parents[j]` with `tokens[j]`."""

    parents: list[int]
    tokens: list[int]
    done: bool


@dataclass(slots=True)
class BeamSearch:
    """The state of one request's beam search over `width` beams."""

    width: int
    length_penalty: float
    max_tokens: int  # generated tokens at most (transformers' max_new_tokens)
    stop_ids: frozenset[int]
    scores: list[float] = field(default_factory=lambda: [0.0])  # running beams' sums
    slots: list[Hypothesis] = field(init=False)  # the k best finished, best first
    num_generated: int = 0
    improvable: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width: must be >= 1, got {self.width}")
        self.slots = [Hypothesis((), _NEG32, finished=False)] * self.width

    @property
    def num_candidates(self) -> int:
        """Continuations the runner returns per running beam (transformers' beams_to_keep)."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def step(
        self, candidates: Sequence[Sequence[tuple[int, float]]], generated: Sequence[Sequence[int]]
    ) -> BeamStep:
        """Advance by one token. `candidates[b]`: running beam b's best continuations
        (token, logprob), at least `num_candidates` of them or the whole vocabulary;
        `generated[b]`: its generated tokens so far. Before the first step there is one
        running beam (the prompt)."""
        if self.done:
            raise RuntimeError("beam search: step after the end")
        if len(candidates) != len(self.scores) or len(generated) != len(self.scores):
            raise ValueError(f"{len(self.scores)} running beams, got {len(candidates)} rows")
        flat = [
            (_f32(self.scores[b] + logprob), b, token)
            for b, row in enumerate(candidates)
            for token, logprob in row
        ]
        # NOTE: descending score; ties by (beam, token) like topk over the flattened beams
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = flat[: self.num_candidates]
        length = self.num_generated + 1
        hits = [token in self.stop_ids or length >= self.max_tokens for _, _, token in top]
        running = sorted(
            range(len(top)),
            key=lambda i: (-(_f32(top[i][0] + _NEG32) if hits[i] else top[i][0]), i),
        )[: self.width]
        self._update_finished(top, hits, generated, length)
        self.scores = [_f32(top[i][0] + _NEG32) if hits[i] else top[i][0] for i in running]
        self.num_generated = length
        self._check_improvable()
        self.done = not self.improvable or all(hits)
        return BeamStep([top[i][1] for i in running], [top[i][2] for i in running], self.done)

    def _update_finished(
        self,
        top: list[tuple[float, int, int]],
        hits: list[bool],
        generated: Sequence[Sequence[int]],
        length: int,
    ) -> None:
        denominator = _f32(length**self.length_penalty)
        penalty = 0.0 if self.improvable else _NEG32
        merged = list(self.slots)
        for rank, ((score, beam, token), hit) in enumerate(zip(top, hits, strict=True)):
            finished = hit and rank < self.width
            value = _f32(score / denominator)
            if penalty:
                value = _f32(value + penalty)
            if not finished:
                value = _f32(value + _NEG32)
            merged.append(Hypothesis((*generated[beam], token), value, finished))
        order = sorted(range(len(merged)), key=lambda i: (-merged[i].score, i))
        self.slots = [merged[i] for i in order[: self.width]]

    def _check_improvable(self) -> None:
        """transformers' `_check_early_stop_heuristic` with `early_stopping=False`."""
        best = _f32(self.scores[0] / _f32(self.num_generated**self.length_penalty))
        worst = min(h.score for h in self.slots)
        self.improvable = self.improvable and any(
            best > (worst if h.finished else _NEG32) for h in self.slots
        )

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (after the search has ended)."""
        if not self.done:
            raise RuntimeError("beam search: not ended")
        return self.slots[:n]


def beam_stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    """Tokens that end a beam: the model's eos ids (unless `ignore_eos`) and `stop_token_ids`."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return frozenset((*eos, *params.stop_token_ids))


def beam_candidates_per_row(params: SamplingParams, eos_token_ids: Sequence[int]) -> int:
    """`BeamSearch.num_candidates` of a request with these params."""
    return max(2, 1 + len(beam_stop_ids(params, eos_token_ids))) * params.beam_size


def new_beam_search(
    params: SamplingParams, eos_token_ids: Sequence[int], max_tokens: int
) -> BeamSearch:
    """The search of a request (`max_tokens`: what the model's length leaves, at most
    `params.max_tokens`)."""
    return BeamSearch(
        width=params.beam_size,
        length_penalty=params.length_penalty,
        max_tokens=max_tokens,
        stop_ids=beam_stop_ids(params, eos_token_ids),
    )


def hypothesis_finish_is_stop(hypothesis: Hypothesis, stop_ids: frozenset[int]) -> bool:
    """Whether a hypothesis ended on a stop id (else it reached the length limit)."""
    return bool(hypothesis.token_ids) and hypothesis.token_ids[-1] in stop_ids
