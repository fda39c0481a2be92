"""`Sequence`: one request's tokens, progress and blocks, shared by every scheduler.

Progress is two counters (docs/style.md):

    token_ids:  | prompt ............ | output ... |
                |<- num_computed_tokens ->|        (K/V in the cache)
                |<------------- num_tokens ------------>|

Prefill, chunked prefill, prefix hits, resume after preemption and decode all follow from them:
a step computes `token_ids[num_computed_tokens : num_computed_tokens + n]`, and when that reaches
`num_tokens` the model's last row is sampled to get the next token.

`make_sequence` is the one way every engine builds a sequence from a request: it validates the
request against the model (InvalidArgument naming the field). This module imports no torch.

A request with several samples (`params.num_samples > 1`: `n` / `best_of`) is one `SampleGroup`:

    sample 0 (the request's own id) ── prompt computed once ── first tokens of every sample
        │ fork_samples: each sample's table shares the prompt's blocks (one reference each)
        ├── sample 1 (id "<request>#1")      the shared partial last block is copied by the
        └── sample k-1                       first sample that writes it (copy-on-write)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from pagedserve.errors import InvalidArgument
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash, extend_block_hashes
from pagedserve.model.requests.batch import TokenLogprobs
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.model.config import ModelConfig
    from pagedserve.model.requests.beam_search import BeamSearch

RequestId = NewType("RequestId", str)

MAX_SAMPLES = 256
"""Most samples per request a worker accepts (the router's `--max-n` is the user-facing bound)."""


def sample_request_id(request_id: str, index: int) -> RequestId:
    """The id sample `index` of a request runs under: the request's own id for sample 0."""
    return RequestId(request_id if index == 0 else f"{request_id}#{index}")


def sample_request_ids(request_id: str, num_samples: int) -> list[RequestId]:
    """The ids of every sample of a request, by index."""
    return [sample_request_id(request_id, index) for index in range(num_samples)]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos or a stop token id
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class Sequence:
    """A request inside one engine. The owner of `block_table` frees it when it finishes."""

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    block_table: BlockTable
    model_fingerprint: bytes
    cache_salt: str = ""
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    sample_index: int = 0
    group: SampleGroup | None = None  # set once the request's samples are forked
    # A prefill worker's multi-sample request: the first tokens of samples 1 .. k-1, drawn
    # with sample 0's (it hands them to the decode worker, which forks there).
    fork_first_tokens: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    # A prefill worker's beam search: the prompt's best continuations (token, logprob), from
    # which the decode worker takes the search's first step.
    beam_candidates: list[tuple[int, float]] = field(default_factory=list)
    # With params.prompt_logprobs: those of prompt tokens 1 .. len, collected chunk by chunk
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Speculative decoding: tokens proposed for it and verified, and of those accepted; with a
    # draft model, the positions whose draft KV is valid (model/draft.py)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_computed: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while sample 0 of a request with `params.prompt_logprobs` lacks some of them:
        its prompt is then computed whole (no prefix-cache hit) and its forwards return them."""
        return (
            self.params.prompt_logprobs is not None
            and self.sample_index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def forks_pending(self) -> bool:
        """True for a multi-sample request's sample 0 whose samples are not forked yet: its
        first sampled step draws a first token for every sample (`fork_samples`)."""
        return self.group is None and self.params.num_samples > 1

    def update_block_hashes(self) -> list[BlockHash]:
        """Hash the blocks that became full since the last call; returns the new hashes."""
        return extend_block_hashes(
            self.block_hashes,
            self.token_ids,
            self.block_table.block_size,
            model_fingerprint=self.model_fingerprint,
            cache_salt=self.cache_salt,
        )

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        self.update_block_hashes()

    def check_stop(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> bool:
        """Finish the sequence if its last token ends it; token-level stops only.

        Stop *strings* need detokenized text and are the router's job.
        """
        if self.num_output_tokens == 0:
            return False
        last = self.token_ids[-1]
        params = self.params
        if self.num_output_tokens >= params.min_tokens and (
            (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids
        ):
            self.finish(FinishReason.STOP)
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH)
        return self.is_finished

    def first_token_finish(
        self, token_id: int, max_model_len: int, eos: tuple[int, ...]
    ) -> FinishReason | None:
        """How a sample of this request whose first output token is `token_id` ends at once
        (`check_stop`'s rules for one output token), or None when it goes on."""
        params = self.params
        if params.min_tokens <= 1 and (
            (not params.ignore_eos and token_id in eos) or token_id in params.stop_token_ids
        ):
            return FinishReason.STOP
        if params.max_tokens <= 1 or self.num_prompt_tokens + 1 >= max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason


@dataclass(slots=True, eq=False)
class SampleGroup:
    """The samples of one request, by index; `request_id` is the request's (sample 0's) id."""

    request_id: RequestId
    members: list[Sequence]
    beam: BeamSearch | None = None  # a beam search's state (the members are its beams)


def fork_samples(
    parent: Sequence, first_tokens: list[tuple[int, TokenLogprobs | None]]
) -> list[Sequence]:
    """Samples 1 .. k-1 of `parent` (sample 0, its first output token already appended), each
    given its own first token; returns them in index order and sets every member's `group`.

    Each sample's table is a fork of `parent`'s: every prompt block is shared (one more
    reference), and the parent's table must hold exactly the prompt's computed slots (the
    first output token has no slot yet). A sample that has no blocks to share (the parent's
    table is empty: it is queued for recompute) starts empty and recomputes its prompt.
    """
    if parent.num_output_tokens != 1:
        raise ValueError(
            f"{parent.request_id}: fork after the first token, not after {parent.num_output_tokens}"
        )
    children: list[Sequence] = []
    for index, (token_id, logprobs) in enumerate(first_tokens, start=1):
        table = parent.block_table
        child = Sequence(
            request_id=sample_request_id(parent.request_id, index),
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params.for_sample(index),
            block_table=table.fork() if table.block_ids else BlockTable(table.pool),
            model_fingerprint=parent.model_fingerprint,
            cache_salt=parent.cache_salt,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            token_ids=[*parent.prompt_token_ids, token_id],
            num_computed_tokens=parent.num_computed_tokens if table.block_ids else 0,
            num_cached_prompt_tokens=parent.num_cached_prompt_tokens,
            sample_index=index,
        )
        child.output_logprobs.append(logprobs)
        children.append(child)
    group = SampleGroup(parent.request_id, [parent, *children])
    for seq in group.members:
        seq.group = group
    return children


def validate_request(
    model_config: ModelConfig,
    max_model_len: int,
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> None:
    """Raise InvalidArgument naming the field if the request cannot run on this model.

    Shared by every engine; capacity (does it fit this worker's KV cache) is each engine's own
    policy, not checked here.
    """
    if not prompt_token_ids:
        raise InvalidArgument("prompt_token_ids", "must not be empty")
    if any(t < 0 or t >= model_config.vocab_size for t in prompt_token_ids):
        raise InvalidArgument("prompt_token_ids", f"ids must be < {model_config.vocab_size}")
    params.validate(
        vocab_size=model_config.vocab_size,
        max_model_len=max_model_len,
        prompt_len=len(prompt_token_ids),
        max_n=MAX_SAMPLES,
    )


# NOTE: the engine's fixed context (config, length, pool, fingerprint) and the request's fields;
# each engine binds the first four once in its own `new_sequence`.
def make_sequence(  # noqa: PLR0913
    model_config: ModelConfig,
    max_model_len: int,
    pool: BlockPool,
    fingerprint: bytes,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    priority: int = 0,
    cache_salt: str = "",
) -> Sequence:
    """A validated `Sequence` with an empty block table of `pool`, not queued anywhere.

    Shared by every engine; raises InvalidArgument naming the field for a bad request.
    """
    validate_request(model_config, max_model_len, prompt_token_ids, params)
    return Sequence(
        request_id=RequestId(request_id),
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        block_table=BlockTable(pool),
        model_fingerprint=fingerprint,
        cache_salt=cache_salt,
        priority=priority,
    )
