"""`PrefillScheduler`: which prompts (and which chunks of them) run in the next prefill step.

Prompts wait in a heap ordered by `(priority, arrival)` (lower priority value runs sooner). Each
step first continues the prompts already started (chunked prefill keeps its place), then admits
waiting prompts in heap order while the token budget, the seat limit and the pool allow:

    step budget: | continuing chunks | new prompts (prefix-cache hits cost only their suffix) |

A prompt is done when its last token has been computed and the first output token sampled; its
blocks then belong to whoever takes the `Sequence` from `update()` (the worker leases them). The
scheduler never touches tensors (nor imports torch): it plans with model/requests/batch.py's
`StepPlan`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import RunnerOutput, ScheduledSequence, StepPlan
from pagedserve.model.requests.progress import admit, advance
from pagedserve.model.requests.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class PrefillSchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64  # prompts in flight (started, not done)
    enable_prefix_caching: bool = True


class PrefillScheduler:
    """Owns queued and in-flight prompts, and their blocks until `update()` hands them over."""

    def __init__(
        self,
        kv: KVCacheManager,
        config: PrefillSchedulerConfig,
        *,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._order = itertools.count()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, seq in self._waiting if not seq.is_finished)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet computed, queued or in flight (the routing load signal)."""
        waiting = sum(s.num_tokens for _, _, s in self._waiting if not s.is_finished)
        return waiting + sum(s.num_tokens - s.num_computed_tokens for s in self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def is_in_flight(self, seq: Sequence) -> bool:
        """Whether `seq` itself (not an aborted namesake) is still queued or running here."""
        return self._by_id.get(seq.request_id) is seq

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request_id: {seq.request_id!r} is already queued")
        self._by_id[seq.request_id] = seq
        heapq.heappush(self._waiting, (seq.priority, next(self._order), seq))

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a queued or in-flight prompt and free its blocks now; None if unknown."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq.block_table)  # NOTE: a queued prompt holds no blocks: a no-op
        seq.finish(FinishReason.ABORT)  # queued entries are skipped lazily in the heap
        return seq

    def schedule(self) -> StepPlan:
        """The next step's chunks (allocated) and the copy-on-write pairs to apply before them."""
        budget = self.config.max_num_batched_tokens
        plan = StepPlan()
        for seq in self.running:
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            pairs = self.kv.allocate(seq.block_table, seq.num_computed_tokens + n)
            if pairs is None:
                break  # NOTE: blocks free up as prompts finish and leases end; wait for them
            plan.copies += pairs
            plan.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = self._peek()
            if head is None:
                break
            admitted = admit(
                self.kv, head, budget, prefix_caching=self.config.enable_prefix_caching
            )
            if admitted is None:
                break
            heapq.heappop(self._waiting)
            item, pairs = admitted
            self.running.append(head)
            plan.scheduled.append(item)
            plan.copies += pairs
            budget -= item.num_new_tokens
        return plan

    def update(self, plan: StepPlan, output: RunnerOutput) -> list[Sequence]:
        """Apply a step's results; returns the prompts that are done, in batch order.

        A done prompt has its first token appended (and may already be FINISHED if that token
        ends it); its blocks are no longer this scheduler's: the caller must lease or free them.
        A prompt aborted since `schedule()` is skipped (its blocks were freed by `abort`).
        `plan` may be any part of a scheduled plan (the engine applies a failed step's chunks
        one at a time), as long as each chunk is applied at most once.
        """
        done = []
        for i, (item, sampled) in enumerate(zip(plan.scheduled, output.sampled, strict=True)):
            if not self.is_in_flight(item.seq):
                continue  # NOTE: aborted while its forward ran: nothing to advance or register
            advance(
                self.kv,
                item,
                sampled,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                prompt_logprobs=output.prompt_logprobs_of(i),
            )
            if sampled is not None:
                self.running.remove(item.seq)
                del self._by_id[item.seq.request_id]
                done.append(item.seq)
        return done

    def _peek(self) -> Sequence | None:
        while self._waiting and self._waiting[0][2].status is SequenceStatus.FINISHED:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None
