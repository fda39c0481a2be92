"""The contracts between a scheduler and the model runner: plain data, no tensors (architecture.md).

    scheduler ── StepPlan (scheduled chunks, copy-on-write pairs) ──► ModelRunner
    scheduler ◄── RunnerOutput (one SampledToken or None per scheduled chunk) ──┘

Tensors stay inside the runner, the sampler and the kernels; a caller that wants the logits
asks the runner for them beside the output (`ModelRunner.execute_with_logits`). This module
imports no torch, so schedulers, plans and `Sequence` are testable without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.kvstore.block_pool import BlockId

if TYPE_CHECKING:
    from pagedserve.model.requests.sequence import Sequence


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one chosen token, from the raw model logits (before penalties/temperature).

    `rank` is 1 for the most likely token (ties count against the token, as in vLLM); `top` holds
    the `params.logprobs` most likely `(token_id, logprob)` pairs, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


# A proposal slot a draft model fills before the forward (`ScheduledSequence.draft`)
DRAFT_PENDING = -1


@dataclass(slots=True)
class ScheduledSequence:
    """`num_new_tokens` of `seq`, starting at `seq.num_computed_tokens`, run this step; with
    `draft` (speculative decoding: the chunk is the last token), those proposed tokens follow
    it in the same forward, in slots the scheduler allocated beyond `seq.num_tokens`, and the
    runner verifies them (`SampledToken.extra`)."""

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def num_query_tokens(self) -> int:
        """Tokens this chunk feeds the model: its own and the proposed ones."""
        return self.num_new_tokens + len(self.draft)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last known token, so the next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    """What the runner executes in one step: copy-on-write pairs first, then the chunks.

    Every chunk in `scheduled` has its slots allocated; its `num_computed_tokens` is advanced
    by the scheduler's `update`, not here. A worker's scheduler may extend this with its own
    decisions (the decode worker's `DecodePlan` adds swaps and preemptions).
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)


@dataclass(slots=True)
class SampledToken:
    """A sampled token; for a multi-sample request's first token (`Sequence.forks_pending`),
    `forks` holds the first tokens of samples 1 .. k-1, drawn from the same logits; for a beam
    of a beam search, `candidates` (and `token_id` is the most likely of them)."""

    token_id: int
    logprobs: TokenLogprobs | None
    forks: list[SampledToken] = field(default_factory=list)
    # A beam of a beam search is not sampled: its best continuations (token, logprob)
    candidates: list[tuple[int, float]] = field(default_factory=list)
    # A speculating chunk: the tokens emitted after `token_id`, in order. `token_id` and
    # every one of them but the last are accepted proposals; the last is the target's own.
    extra: list[int] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        """Proposed tokens the target model agreed with (each emitted token but the last)."""
        return len(self.extra)


@dataclass(slots=True)
class RunnerOutput:
    """Per scheduled sequence (same order): the sampled token, or None for a partial chunk;
    `prompt_logprobs` (empty: none in the whole step): per scheduled sequence, the logprobs of
    the prompt tokens this chunk's logits give (`Sequence.wants_prompt_logprobs`), in order."""

    sampled: list[SampledToken | None]
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)

    def prompt_logprobs_of(self, index: int) -> list[TokenLogprobs]:
        """Scheduled sequence `index`'s prompt logprobs of this step (maybe none)."""
        return self.prompt_logprobs[index] if self.prompt_logprobs else []
