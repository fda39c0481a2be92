"""The decode scheduler's plain data: its limits (`SchedulerConfig`), what it decides for one
step (`DecodePlan`) and what it counts (`SchedulerStats`).

No tensors (no torch import). `DecodePlan` is the runner's `StepPlan`
(model/requests/batch.py: chunks and copy-on-write pairs) plus the decode worker's own
decisions: swaps, preemptions, failures. The engine executes a plan in this order
(docs/scheduling.md)::

    swaps              ─► Swapper (one FIFO queue: this plan's copies in the order decided)
    copies             ─► ModelRunner.copy_blocks   (after pending swap-outs of their dst blocks)
    scheduled          ─► ModelRunner.execute       (after this plan's swap-ins have landed)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.kvstore.block_pool import BlockId
from pagedserve.model.requests.batch import StepPlan
from pagedserve.model.requests.sequence import Sequence


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"  # arrival order only; `priority` is ignored
    PRIORITY = "priority"  # lower `priority` runs sooner, then arrival order


class PreemptionMode(enum.Enum):
    AUTO = "auto"  # per victim: swap when it fits and the cost model says it is cheaper
    SWAP = "swap"  # swap when the swap space has room, else recompute
    RECOMPUTE = "recompute"  # always drop the blocks and recompute later


class KVPolicy(enum.Enum):
    PAGED = "paged"  # blocks are allocated as tokens arrive (PagedAttention)
    # Every sequence holds slots for its worst case (prompt + max_tokens, capped at
    # max_model_len) from admission on: the traditional reservation, kept so that benchmarks
    # compare paged and reserved KV on the same code (docs/benchmarks/method.md S3).
    RESERVE_MAX = "reserve-max"


class SwapDirection(enum.Enum):
    IN = "in"  # swap space -> device: (host, device) pairs
    OUT = "out"  # device -> swap space: (device, host) pairs


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and policy of one decode scheduler; validated here, once."""

    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: SchedulingPolicy = SchedulingPolicy.PRIORITY
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    min_priority_gap: int = 1  # a waiting/swapped sequence displaces running ones this much worse
    # A sequence preempted this often is no longer picked as a victim (0: each only yields itself).
    max_preemptions: int = 4
    bytes_per_block: int = 0  # for the swap byte counters and the cost model
    eos_token_ids: tuple[int, ...] = ()
    kv_policy: KVPolicy = KVPolicy.PAGED

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "min_priority_gap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_preemptions", "bytes_per_block"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class SwapCopies:
    """A run of one plan's swap copies in one direction."""

    direction: SwapDirection
    pairs: list[tuple[BlockId, BlockId]]


@dataclass(frozen=True, slots=True)
class Preemption:
    """`seq` left the running set this step, by `mode` (SWAP or RECOMPUTE)."""

    seq: Sequence
    mode: PreemptionMode
    num_blocks: int  # blocks moved to host (SWAP) or released (RECOMPUTE)


@dataclass(frozen=True, slots=True)
class FailedSequence:
    """`seq` was finished with FinishReason.ERROR; `message` says why, for the client."""

    seq: Sequence
    message: str


@dataclass(slots=True)
class DecodePlan(StepPlan):
    """One step's decisions. Block pairs are ids in the device pool and the swap space's pool.

    Every sequence in `scheduled` has its slots for this step allocated; its
    `num_computed_tokens` is advanced by `Scheduler.update`, not here.
    """

    # NOTE: in the order the scheduler decided them, and the Swapper keeps that order: a block
    # freed by one decision may be the destination of a later one in the same step (a victim
    # displaced for a swap-in frees the device blocks that swap-in then fills; a swap-in frees
    # host blocks that a later swap-out fills). Reordering them (say, every swap-in first)
    # overwrites a block before the copy that reads it.
    swaps: list[SwapCopies] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    recomputed: list[Sequence] = field(default_factory=list)  # re-admitted after RECOMPUTE
    swapped_in: list[Sequence] = field(default_factory=list)
    failed: list[FailedSequence] = field(default_factory=list)

    def add_swaps(self, direction: SwapDirection, pairs: list[tuple[BlockId, BlockId]]) -> None:
        """Append copies after every copy decided so far."""
        if not pairs:
            return
        if self.swaps and self.swaps[-1].direction is direction:
            self.swaps[-1].pairs.extend(pairs)
        else:
            self.swaps.append(SwapCopies(direction, list(pairs)))

    @property
    def swap_in(self) -> list[tuple[BlockId, BlockId]]:
        """Every (host, device) swap-in pair, in order."""
        return [pair for c in self.swaps if c.direction is SwapDirection.IN for pair in c.pairs]

    @property
    def swap_out(self) -> list[tuple[BlockId, BlockId]]:
        """Every (device, host) swap-out pair, in order."""
        return [pair for c in self.swaps if c.direction is SwapDirection.OUT for pair in c.pairs]

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swaps or self.preempted or self.failed)


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters of one scheduler (exported as metrics by the servicer)."""

    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swap_out_blocks: int = 0
    num_swap_in_blocks: int = 0
    num_swap_out_bytes: int = 0
    num_swap_in_bytes: int = 0
    num_swap_in_cache_hits: int = 0  # blocks found still cached on the device: no copy needed
    num_swapped_recomputed: int = 0  # swapped sequences dropped to recompute to break a stall
    num_failed: int = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_swap + self.num_preemptions_recompute
