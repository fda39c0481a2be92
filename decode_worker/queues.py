"""The decode scheduler's queues (`SequenceQueues`) and one `schedule()` call in progress
(`PlanDraft`). Plain bookkeeping, no tensors (no torch import).

Each queued sequence is in exactly one queue::

    waiting  heap on rank        not started, or preempted by RECOMPUTE (holds no blocks)
    running  list                holds a device block table
    swapped  list sorted by rank preempted by SWAP (its `SwappedBlocks` record: the `Preemptor`'s)

    rank = (priority, arrival)   under the `priority` policy (lower runs sooner)
    rank = (0, arrival)          under `fcfs`

Moving an entry between queues frees nothing: whoever moves it frees what it held.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pagedserve.decode_worker.plan import DecodePlan, SchedulingPolicy
from pagedserve.kvstore.block_pool import BlockId
from pagedserve.model.requests.batch import ScheduledSequence
from pagedserve.model.requests.sequence import RequestId, Sequence, SequenceStatus

Rank = tuple[int, int]
Pairs = list[tuple[BlockId, BlockId]]


@dataclass(slots=True, eq=False)
class QueueEntry:
    """The scheduler's private state of one sequence."""

    seq: Sequence
    rank: Rank
    num_preemptions: int = 0
    recompute_pending: bool = False  # preempted by RECOMPUTE and not re-admitted yet

    def __lt__(self, other: QueueEntry) -> bool:
        return self.rank < other.rank


@dataclass(slots=True)
class PlanDraft:
    """One `schedule()` call in progress: the token budget left and what is scheduled so far."""

    plan: DecodePlan
    budget: int
    items: dict[RequestId, ScheduledSequence] = field(default_factory=dict)
    copies: dict[RequestId, Pairs] = field(default_factory=dict)

    def add(self, entry: QueueEntry, num_new_tokens: int, copies: Pairs) -> None:
        self.items[entry.seq.request_id] = ScheduledSequence(entry.seq, num_new_tokens)
        self.copies[entry.seq.request_id] = copies
        self.budget -= num_new_tokens

    def add_draft(self, item: ScheduledSequence, draft: list[int], copies: Pairs) -> None:
        """Give a scheduled decode chunk proposals to verify (their slots already allocated)."""
        seq = item.seq
        self.items[seq.request_id] = ScheduledSequence(seq, item.num_new_tokens, tuple(draft))
        self.copies[seq.request_id] += copies
        self.budget -= len(draft)

    def tokens_of(self, entry: QueueEntry) -> int:
        item = self.items.get(entry.seq.request_id)
        return item.num_query_tokens if item else 0

    def remove(self, entry: QueueEntry) -> Pairs:
        """Unschedule `entry` (a victim); return the copy-on-write pairs it had asked for."""
        self.budget += self.tokens_of(entry)
        self.items.pop(entry.seq.request_id, None)
        return self.copies.pop(entry.seq.request_id, [])

    def finish(self) -> DecodePlan:
        self.plan.scheduled = list(self.items.values())
        self.plan.copies = [pair for pairs in self.copies.values() for pair in pairs]
        return self.plan


class SequenceQueues:
    """Every queued sequence's entry, by request id, and the queue it is in.

    The three lists are never replaced (callers may hold them); `push_*` set the sequence's
    status, `register` and `forget` add and drop the entry.
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.waiting: list[QueueEntry] = []
        self.running: list[QueueEntry] = []
        self.swapped: list[QueueEntry] = []
        self.entries: dict[RequestId, QueueEntry] = {}
        self._arrivals = itertools.count()

    def new_rank(self, seq: Sequence) -> Rank:
        priority = seq.priority if self.policy is SchedulingPolicy.PRIORITY else 0
        return (priority, next(self._arrivals))

    def check_unused(self, seq: Sequence) -> None:
        """ValueError when `seq`'s request id is already queued."""
        if seq.request_id in self.entries:
            raise ValueError(f"request_id: {seq.request_id!r} is already queued")

    def register(self, seq: Sequence, rank: Rank) -> QueueEntry:
        """A new entry for `seq` (in no queue yet). ValueError on a request id in use."""
        self.check_unused(seq)
        entry = self.entries[seq.request_id] = QueueEntry(seq, rank)
        return entry

    def push_waiting(self, entry: QueueEntry) -> None:
        entry.seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, entry)

    def push_running(self, entry: QueueEntry) -> None:
        entry.seq.status = SequenceStatus.RUNNING
        self.running.append(entry)

    def push_swapped(self, entry: QueueEntry) -> None:
        entry.seq.status = SequenceStatus.SWAPPED
        self.swapped.append(entry)
        self.swapped.sort()

    def pop_waiting(self) -> QueueEntry:
        """Take the best-ranked waiting entry out of `waiting` (it stays registered)."""
        return heapq.heappop(self.waiting)

    def requeue_for_recompute(self, entry: QueueEntry) -> None:
        """Back to waiting with nothing computed; prompt + generated tokens are recomputed."""
        entry.seq.num_computed_tokens = 0
        entry.recompute_pending = True
        self.push_waiting(entry)

    def take(self, entry: QueueEntry) -> None:
        """Take `entry` out of its queue (it stays registered)."""
        if entry in self.running:
            self.running.remove(entry)
        elif entry in self.swapped:
            self.swapped.remove(entry)
        elif entry in self.waiting:
            self.waiting.remove(entry)
            heapq.heapify(self.waiting)

    def forget(self, entry: QueueEntry) -> None:
        """Take `entry` out of its queue and drop it."""
        self.take(entry)
        del self.entries[entry.seq.request_id]

    def members_of(self, request_id: str) -> list[Sequence]:
        """The queued sequences of request `request_id`: its own, and its other samples'."""
        return [
            entry.seq
            for rid, entry in self.entries.items()
            if rid == request_id
            or (entry.seq.group is not None and entry.seq.group.request_id == request_id)
        ]

    def mates(self, entry: QueueEntry, queue: list[QueueEntry]) -> list[QueueEntry]:
        """The other samples of `entry`'s request that are in `queue`, in sample order."""
        group = entry.seq.group
        if group is None:
            return []
        mates = [self.entries.get(seq.request_id) for seq in group.members]
        return [m for m in mates if m is not None and m is not entry and m in queue]

    def check_integrity(self) -> None:
        """RuntimeError unless each entry is in exactly one queue, and only running ones hold
        a block table."""
        queued = [*self.waiting, *self.running, *self.swapped]
        if len(queued) != len(set(map(id, queued))) or len(queued) != len(self.entries):
            raise RuntimeError(
                f"integrity: {len(self.entries)} sequences, queues hold {len(queued)} entries"
            )
        if any(e.seq.block_table.block_ids for e in (*self.waiting, *self.swapped)):
            raise RuntimeError("integrity: a waiting or swapped sequence holds a block table")
