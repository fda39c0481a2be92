"""Speculative decoding's proposing side: n-gram prompt lookup and an adaptive k (torch-free).

A speculating step feeds a sequence its last token plus `k` proposed tokens and verifies them
all in one forward (model/runner.py)::

    fed:      | x_last | d_1 | d_2 | ... | d_k |          positions p .. p + k
    target:   |  t_0   | t_1 | t_2 | ... | t_k |          each position's next token
    accepted: d_i while d_i == t_(i-1); emitted t_0 .. t_m (m accepted drafts, 1 + m tokens)

Greedy verification (`accept_greedy`) keeps exactly the tokens greedy decoding would produce one
at a time; sampled rows use rejection sampling (`Sampler.verify_draft`), which keeps each
token's distribution exactly. The scheduler (scheduler.py) asks `Speculator.propose` for each
running decode sequence after everything else of the step is decided, and gives proposals only
free slots: speculation never preempts, never displaces an admission, and its rejected slots
are trimmed after the step.

Which sequences speculate: those whose sampler chooses from the raw logits through
temperature, top-k, top-p and min-p alone (no penalties, logit bias, allowed or banned tokens,
pending min_tokens, logprobs, beams or pending forks; a grammar masks every verified position,
model/grammar.py). Every other sequence runs with k = 0 in the same batch. See
docs/speculative.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pagedserve.model.requests.batch import DRAFT_PENDING
from pagedserve.model.requests.sequence import Sequence


class SpeculativeMethod(enum.Enum):
    NGRAM = "ngram"
    DRAFT = "draft"  # a smaller model of the same vocabulary (model/draft.py)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`--speculative-method`, `--num-speculative-tokens` and the lookup's limits."""

    method: SpeculativeMethod = SpeculativeMethod.NGRAM
    num_tokens: int = 4  # k: the most tokens proposed per sequence and step
    ngram_min: int = 1  # the shortest suffix matched
    ngram_max: int = 4  # the longest suffix matched (tried first)
    # No proposals while more sequences than this run: verifying k tokens for each of a large
    # batch costs compute the weights' one read no longer hides (the step is no longer bound
    # by reading the weights).
    max_batch: int = 8
    draft_model: str | None = None  # the draft's model directory (method DRAFT)

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num-speculative-tokens: must be in [1, 16], got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"speculative-ngram-min: must be in [1, speculative-ngram-max = "
                f"{self.ngram_max}], got {self.ngram_min}"
            )
        if self.max_batch < 1:
            raise ValueError(f"speculative-max-batch: must be >= 1, got {self.max_batch}")
        if (self.method is SpeculativeMethod.DRAFT) != (self.draft_model is not None):
            raise ValueError(
                "speculative-model: a draft model directory goes with --speculative-method "
                f"draft and only with it (method {self.method.value}, model {self.draft_model})"
            )


def ngram_proposal(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Prompt lookup: the `k` tokens that followed the latest earlier occurrence (with `k`
    tokens after it, if any has) of the longest suffix of `tokens` (length `ngram_max` down to
    `ngram_min`); [] when none recurs.

        tokens:  ... | a b c | e f g ... | a b c |      suffix "a b c" found earlier
        proposal:            | e f g ... |              up to k tokens after it
    """
    if k < 1 or len(tokens) < ngram_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = arr[-n:]
        # NOTE: windows start at 0 .. len - n - 1, so the suffix itself is never a match
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # NOTE: the latest occurrence with k tokens after it; in a periodic run the latest
            # one of all sits right before the suffix and would leave too short a proposal
            full = hits[hits + n + k <= len(tokens)]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k]
    return []


@dataclass(slots=True)
class SpeculationStats:
    """Cumulative counts (exported as metrics by the decode worker)."""

    num_drafts: int = 0  # sequence-steps that verified at least one proposed token
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, tokens the target model agreed with

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Proposes tokens for a sequence and learns, per sequence, how many are worth it.

    Adaptive k: each sequence keeps an exponential average of its acceptance fraction; its k is
    `num_tokens` scaled by that average (at least 1, so a sequence whose text starts to repeat
    is noticed). Keyed by request id; `forget` drops a finished sequence's average.
    """

    ALPHA = 0.3  # weight of the newest step in the average
    PRIOR = 1.0  # a new sequence starts trusted: the first proposal is at full k

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpeculationStats()
        self._rate: dict[str, float] = {}

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` (and k) tokens to verify after `seq`'s last token; [] for none.
        With a draft model, k `DRAFT_PENDING` slots the engine fills before the forward."""
        if max_tokens < 1 or not eligible(seq):
            return []
        rate = self._rate.get(seq.request_id, self.PRIOR)
        k = min(max_tokens, max(1, round(self.config.num_tokens * rate)))
        if self.config.method is SpeculativeMethod.DRAFT:
            return [DRAFT_PENDING] * k
        return ngram_proposal(seq.token_ids, self.config.ngram_min, self.config.ngram_max, k)

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Count one verification of `num_proposed` tokens, `num_accepted` of them kept."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_proposed
        self.stats.num_accepted_tokens += num_accepted
        seq.num_draft_tokens += num_proposed
        seq.num_accepted_tokens += num_accepted
        old = self._rate.get(seq.request_id, self.PRIOR)
        self._rate[seq.request_id] = (1 - self.ALPHA) * old + self.ALPHA * (
            num_accepted / num_proposed
        )

    def forget(self, request_id: str) -> None:
        self._rate.pop(request_id, None)


def eligible(seq: Sequence) -> bool:
    """Whether verification gives `seq` exactly what its sampler would: the sampler chooses
    from the raw logits through temperature, top-k, top-p and min-p alone (greedy: the argmax)
    and wants nothing per token."""
    p = seq.params
    return (
        p.speculative
        and not p.use_beam_search
        and p.logprobs is None
        and not seq.forks_pending
        and not seq.wants_prompt_logprobs
        and not p.changes_logits
        # NOTE: every verified position's output is at least this long, so min_tokens bans
        # no token in any of them
        and seq.num_output_tokens >= p.min_tokens
    )
