"""Preemption: the swap/recompute cost model, a swapped sequence's block record, and the
`Preemptor` that chooses victims and carries preemptions out.

Tensor-free: these functions move block *ids* between the device `BlockPool` and the swap
space's pool and return the copies the `Swapper` must perform.

A swapped-out sequence, block by block (block_size 4, 10 computed tokens)::

    table before:   [ d3 (ref 2, shared) | d7 (ref 1) | d9 (ref 1, partial) ]
    SwappedBlocks:    device [ d3,   None, None ]      d3 stays on the device, referenced
                      host   [ None, h0,   h1   ]      d7 → h0, d9 → h1 copied out, d7/d9 freed
                      hashes [ H0,   H1,   None ]      full blocks only
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedserve.decode_worker.plan import (
    Preemption,
    PreemptionMode,
    SchedulerConfig,
    SchedulerStats,
    SchedulingPolicy,
    SwapDirection,
)
from pagedserve.decode_worker.queues import Pairs, PlanDraft, QueueEntry, SequenceQueues
from pagedserve.kvstore.block_pool import BlockId, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.sequence import RequestId, Sequence


@dataclass(slots=True)
class PreemptionCostModel:
    """A small cost model for choosing a victim's preemption mode (docs/scheduling.md).

        swap_s      = swap_overhead_s + 2 · blocks · bytes_per_block / swap_bytes_per_s
        recompute_s = tokens_to_recompute / prefill_tokens_per_s

    `2 ·`: the blocks are copied out now and back in later. `tokens_to_recompute` excludes the
    leading blocks shared with other sequences (they stay cached, so recompute hits them).
    With `measure=True` the engine feeds measured speeds in (`observe_*`, exponential moving
    average with weight `smoothing`); the defaults are the prior before anything is measured.
    """

    swap_bytes_per_s: float = 10e9  # one direction, pinned host memory over PCIe
    prefill_tokens_per_s: float = 8e3
    swap_overhead_s: float = 2e-4  # per victim: issuing the copies and waiting for them
    measure: bool = True
    smoothing: float = 0.2

    def __post_init__(self) -> None:
        for name in ("swap_bytes_per_s", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.swap_overhead_s < 0:
            raise ValueError(f"swap_overhead_s: must be >= 0, got {self.swap_overhead_s}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing: must be in (0, 1], got {self.smoothing}")

    def swap_seconds(self, num_blocks: int, bytes_per_block: int) -> float:
        return self.swap_overhead_s + 2 * num_blocks * bytes_per_block / self.swap_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_blocks: int, bytes_per_block: int, num_tokens: int) -> bool:
        """Whether swapping `num_blocks` is estimated cheaper than recomputing `num_tokens`."""
        return self.swap_seconds(num_blocks, bytes_per_block) < self.recompute_seconds(num_tokens)

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if self.measure and num_bytes > 0 and seconds > 0:
            self.swap_bytes_per_s = self._blend(self.swap_bytes_per_s, num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if self.measure and num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, num_tokens / seconds)

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


@dataclass(slots=True)
class SwappedBlocks:
    """Where each block of a swapped-out sequence is: `device[i]` or `host[i]`, never both.

    Owns one device-pool reference per non-None `device[i]` and one swap-pool block per
    non-None `host[i]`; exactly one of `swap_in` or `release` returns them.
    """

    device: list[BlockId | None]
    host: list[BlockId | None]
    hashes: list[BlockHash | None]
    num_tokens: int

    @property
    def num_device_blocks(self) -> int:
        return sum(d is not None for d in self.device)


def trim_table(table: BlockTable, num_tokens: int) -> None:
    """Drop the table's slots beyond `num_tokens` (never computed), freeing whole blocks."""
    keep = -(-num_tokens // table.block_size)
    extra = table.block_ids[keep:]
    table.pool.free(reversed(extra))
    del table.block_ids[keep:]
    table.num_tokens = min(table.num_tokens, num_tokens)
    table.num_cached_blocks = min(table.num_cached_blocks, keep)


def exclusive_positions(table: BlockTable) -> list[int]:
    """Positions of the table's blocks no other table or record references (ref count 1)."""
    pool = table.pool
    return [i for i, b in enumerate(table.block_ids) if pool.ref_count(b) == 1]


def group_exclusive_blocks(tables: Seq[BlockTable]) -> list[BlockId]:
    """Blocks of `tables` no one else references (the tables hold every reference), in order
    of first appearance: what swapping the tables out together moves, each block once."""
    counts = Counter(b for table in tables for b in table.block_ids)
    pool = tables[0].pool
    return [b for b in counts if pool.ref_count(b) == counts[b]]


def swap_out_group(
    tables: Seq[BlockTable], block_hashes: Seq[Seq[BlockHash]], host_pool: BlockPool
) -> tuple[list[SwappedBlocks], list[tuple[BlockId, BlockId]]] | None:
    """Move the blocks only `tables` hold (one sequence's, or the samples of one request's)
    to host blocks; blocks someone else also holds stay on the device, referenced::

        sample 0: [ p0 p1 | a2 ]      p0, p1: the prompt's blocks, shared by the samples only
        sample 1: [ p0 p1 | b2 ]      -> copied to the host ONCE: h0, h1 (ref 2 each), h2, h3
        records:  [ h0 h1 h2 ], [ h0 h1 h3 ]

    A moved block's host block is referenced by every record that held it (one host-pool
    reference each). Returns the records (one per table) and the `(device, host)` copies to
    perform, and leaves the tables empty: the freed device blocks may be reallocated at once, so
    the copies must finish before anything writes them (see `Swapper`). Returns None, changing
    nothing, when the swap space is short.
    """
    moved = group_exclusive_blocks(tables)
    host_ids = host_pool.allocate(len(moved))
    if host_ids is None:
        return None
    host_of = dict(zip(moved, host_ids, strict=True))
    records = []
    for table, hashes in zip(tables, block_hashes, strict=True):
        num_full = min(len(hashes), table.num_tokens // table.block_size)
        record = SwappedBlocks(
            device=list[BlockId | None](table.block_ids),
            host=[None] * len(table.block_ids),
            hashes=[hashes[i] if i < num_full else None for i in range(len(table.block_ids))],
            num_tokens=table.num_tokens,
        )
        for position, device_id in enumerate(table.block_ids):
            host_id = host_of.get(device_id)
            if host_id is not None:
                record.device[position] = None
                record.host[position] = host_id
        records.append(record)
    # NOTE: a host block held by several records gets one more reference per extra record
    extra = [h for r in records for h in r.host if h is not None]
    for host_id in host_ids:
        extra.remove(host_id)
    host_pool.acquire(extra)
    for table in tables:
        # NOTE: tail first, like BlockTable.free: cached tails are evicted before cached heads.
        table.pool.free(reversed([b for b in table.block_ids if b in host_of]))
        table.block_ids = []
        table.num_tokens = 0
        table.num_cached_blocks = 0
    return records, list(host_of.items())


def swap_in_group_cost(records: Seq[SwappedBlocks], pool: BlockPool) -> int:
    """Device blocks `swap_in_group(records, ...)` takes from `pool`'s allocatable set; changes
    nothing. A host block shared by several records costs one device block; one whose hash is
    still cached on the device is re-acquired, not copied (a CACHED one still leaves the
    allocatable set, so it counts too)."""
    cost = 0
    seen: set[BlockId] = set()
    for record in records:
        for position, host_id in enumerate(record.host):
            if host_id is None or host_id in seen:
                continue
            seen.add(host_id)
            hit = _device_hit(record, position, pool)
            cost += hit is None or pool.ref_count(hit) == 0
    return cost


def swap_in_group(
    records: Seq[SwappedBlocks], tables: Seq[BlockTable], host_pool: BlockPool
) -> tuple[list[tuple[BlockId, BlockId]], int] | None:
    """Rebuild the empty `tables` from `records` (what `swap_out_group` moved); return the
    `(host, device)` copies and the number of cache hits. A host block the records share is
    copied into ONE device block, which every table references.

    Host blocks are freed here; the swapper reads them before any later swap-out can write
    them (one FIFO queue). Returns None, changing nothing, when the device pool is short. The
    tables' blocks are offered to the prefix cache again by the next `cache_full_blocks`.
    """
    pool = tables[0].pool
    for table in tables:
        if table.block_ids or table.num_tokens:
            raise RuntimeError(f"swap_in: table already holds {table.num_tokens} tokens")
    if not pool.can_allocate(swap_in_group_cost(records, pool)):
        return None
    # NOTE: hits are taken before anything is allocated: an allocation may evict a CACHED
    # block that a later position would have hit (and then cost more than counted)
    hit_of = _hits(records, pool)
    uses = [h for record in records for h in record.host if h is not None]
    pool.acquire([hit_of[h] for h in uses if h in hit_of])
    misses = list(dict.fromkeys(h for h in uses if h not in hit_of))
    fresh = pool.allocate(len(misses))
    if fresh is None:
        raise RuntimeError("swap_in: pool ran short after its cost said it would not")
    copied = dict(zip(misses, fresh, strict=True))
    # NOTE: a fresh block comes with one reference; each further table takes one more
    extra = [copied[h] for h in uses if h in copied]
    for device_id in fresh:
        extra.remove(device_id)
    pool.acquire(extra)
    placed = hit_of | copied  # host block -> its device block
    for record, table in zip(records, tables, strict=True):
        table.block_ids = [
            d if d is not None else placed[_some(h)]
            for d, h in zip(record.device, record.host, strict=True)
        ]
        host_pool.free([h for h in record.host if h is not None])
        table.num_tokens = record.num_tokens
        table.num_cached_blocks = 0
    return list(copied.items()), len(hit_of)


def _hits(records: Seq[SwappedBlocks], pool: BlockPool) -> dict[BlockId, BlockId]:
    """Host block -> the device block that still holds its hash (no copy needed)."""
    hit_of: dict[BlockId, BlockId] = {}
    for record in records:
        for position, host_id in enumerate(record.host):
            if host_id is not None and host_id not in hit_of:
                hit = _device_hit(record, position, pool)
                if hit is not None:
                    hit_of[host_id] = hit
    return hit_of


def release(record: SwappedBlocks, pool: BlockPool, host_pool: BlockPool) -> None:
    """Drop everything `record` holds (abort, or conversion to recompute)."""
    pool.free(reversed([d for d in record.device if d is not None]))
    host_pool.free([h for h in record.host if h is not None])
    record.device = [None] * len(record.device)
    record.host = [None] * len(record.host)


def _some(block_id: BlockId | None) -> BlockId:
    if block_id is None:
        raise RuntimeError("swapped block is neither on the device nor on the host")
    return block_id


def _device_hit(record: SwappedBlocks, position: int, pool: BlockPool) -> BlockId | None:
    block_hash = record.hashes[position]
    return pool.lookup(block_hash) if block_hash is not None else None


class Preemptor:
    """Takes sequences out of the running set and brings swapped ones back: victim choice
    (`victims_for_running`, `displace_for`), preemption by swap or recompute (`preempt`),
    swap-in (`swap_in`). Mutates the queues, the plan being drafted and `stats`; nothing on a
    False return. Owns every swapped sequence's `SwappedBlocks` record: exactly one of
    `swap_in`, `recompute_one_swapped` or `release_swapped` returns what it holds.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        host_pool: BlockPool | None,
        queues: SequenceQueues,
        cost_model: PreemptionCostModel,
        stats: SchedulerStats,
    ) -> None:
        self.config = config
        self.kv = kv
        self.pool = kv.pool
        self.host_pool = host_pool
        self.queues = queues
        self.cost_model = cost_model
        self.stats = stats
        self._records: dict[RequestId, SwappedBlocks] = {}

    def victims_for_running(self, needy: QueueEntry) -> Iterator[QueueEntry]:
        """Worst-ranked running sequences ranked below `needy`, then `needy` itself."""
        for candidate in sorted(self.queues.running, reverse=True):
            if candidate is needy:
                break
            if candidate.num_preemptions < self.config.max_preemptions:
                yield candidate
        yield needy

    def displace_for(
        self,
        entry: QueueEntry,
        draft: PlanDraft,
        need_blocks: int,
        need_tokens: int,
        need_seats: int = 1,
    ) -> bool:
        """Preempt running sequences `entry` may displace until it has `need_seats` seats,
        `need_blocks` allocatable blocks and `need_tokens` of budget; preempt nobody if that
        is impossible."""
        seats = self.config.max_num_seqs - len(self.queues.running) - (need_seats - 1)
        blocks, budget = self.pool.num_allocatable, draft.budget
        victims: list[QueueEntry] = []
        for candidate in sorted(self.queues.running, reverse=True):
            if seats >= 1 and blocks >= need_blocks and budget >= need_tokens:
                break
            if not self._outranks(entry, candidate):
                break
            if candidate.num_preemptions >= self.config.max_preemptions:
                continue
            victims.append(candidate)
            seats += 1
            blocks += len(exclusive_positions(candidate.seq.block_table))
            budget += draft.tokens_of(candidate)
        if not (seats >= 1 and blocks >= need_blocks and budget >= need_tokens):
            return False
        for victim in victims:
            if victim in self.queues.running:  # NOTE: not already preempted with a group mate
                self.preempt(victim, draft)
        return True

    def _outranks(self, entry: QueueEntry, running: QueueEntry) -> bool:
        if self.config.policy is SchedulingPolicy.FCFS:
            return False
        return running.seq.priority - entry.seq.priority >= self.config.min_priority_gap

    # -- preempting ----------------------------------------------------------------------------

    def preempt(self, entry: QueueEntry, draft: PlanDraft) -> None:
        """Take `entry` out of the running set by swap or recompute (see `_choose_mode`), and
        with it every other running sample of its request: a group is preempted as one unit,
        all swapped (each block only the group holds copied once) or all recomputed."""
        members = [entry, *reversed(self.queues.mates(entry, self.queues.running))]  # last first
        had_copies = False
        for member in members:
            had_copies |= bool(draft.remove(member))
            trim_table(member.seq.block_table, member.seq.num_computed_tokens)
            self.queues.running.remove(member)
            member.num_preemptions += 1
        seqs = [member.seq for member in members]
        mode = self._choose_mode(seqs, force_recompute=had_copies)
        if mode is PreemptionMode.SWAP and self._swap_out(members, draft):
            return
        for member in members:
            seq = member.seq
            num_blocks = len(seq.block_table.block_ids)
            self.kv.free(seq.block_table)
            self.queues.requeue_for_recompute(member)
            self.stats.num_preemptions_recompute += 1
            draft.plan.preempted.append(Preemption(seq, PreemptionMode.RECOMPUTE, num_blocks))

    def _choose_mode(self, seqs: list[Sequence], *, force_recompute: bool) -> PreemptionMode:
        """SWAP or RECOMPUTE for the victims (one sequence, or the samples of one request)
        whose tables hold only computed tokens.

        NOTE: a victim with a copy-on-write pending in this plan is recomputed: its copy is
        dropped from the plan, so its new last block holds nothing worth swapping.
        """
        mode = self.config.preemption_mode
        if force_recompute or mode is PreemptionMode.RECOMPUTE or self.host_pool is None:
            return PreemptionMode.RECOMPUTE
        if any(seq.num_computed_tokens == 0 for seq in seqs):
            return PreemptionMode.RECOMPUTE
        moved = group_exclusive_blocks([seq.block_table for seq in seqs])
        if not self.host_pool.can_allocate(len(moved)):
            return PreemptionMode.RECOMPUTE
        if mode is PreemptionMode.SWAP:
            return PreemptionMode.SWAP
        if len(seqs) == 1:
            table = seqs[0].block_table
            exclusive = exclusive_positions(table)
            shared_head = exclusive[0] if exclusive else len(table.block_ids)
            tokens = seqs[0].num_computed_tokens - shared_head * self.pool.block_size
        else:  # NOTE: about what recomputing the blocks only the group holds costs
            tokens = len(moved) * self.pool.block_size
        swap_cheaper = self.cost_model.prefers_swap(len(moved), self.config.bytes_per_block, tokens)
        return PreemptionMode.SWAP if swap_cheaper else PreemptionMode.RECOMPUTE

    def _swap_out(self, members: list[QueueEntry], draft: PlanDraft) -> bool:
        """Swap the (already unscheduled) `members` out together; False, changing nothing,
        when the swap space is short."""
        seqs = [member.seq for member in members]
        result = swap_out_group(
            [seq.block_table for seq in seqs],
            [seq.block_hashes for seq in seqs],
            _some_pool(self.host_pool),
        )
        if result is None:
            return False
        records, pairs = result
        for k, (member, record) in enumerate(zip(members, records, strict=True)):
            self._enter_swapped(member, record, pairs if k == 0 else [], draft)
        return True

    def _enter_swapped(
        self, entry: QueueEntry, record: SwappedBlocks, pairs: Pairs, draft: PlanDraft
    ) -> None:
        self._records[entry.seq.request_id] = record
        self.queues.push_swapped(entry)
        draft.plan.add_swaps(SwapDirection.OUT, pairs)
        draft.plan.preempted.append(Preemption(entry.seq, PreemptionMode.SWAP, len(pairs)))
        self.stats.num_preemptions_swap += 1
        self.stats.num_swap_out_blocks += len(pairs)
        self.stats.num_swap_out_bytes += len(pairs) * self.config.bytes_per_block

    # -- swapped sequences ---------------------------------------------------------------------

    def swap_in(self, group: list[QueueEntry], draft: PlanDraft) -> bool:
        """Swap the swapped entries `group` (the samples of one request) in together, back to
        running; False, changing nothing, when the device pool is short."""
        records = [self.record_of(member) for member in group]
        tables = [member.seq.block_table for member in group]
        result = swap_in_group(records, tables, _some_pool(self.host_pool))
        if result is None:
            return False
        pairs, hits = result
        for member in group:
            self.queues.swapped.remove(member)
            del self._records[member.seq.request_id]
            self.queues.push_running(member)
            draft.plan.swapped_in.append(member.seq)
        draft.plan.add_swaps(SwapDirection.IN, pairs)
        self.stats.num_swap_in_blocks += len(pairs)
        self.stats.num_swap_in_bytes += len(pairs) * self.config.bytes_per_block
        self.stats.num_swap_in_cache_hits += hits
        return True

    def recompute_one_swapped(self, keep: QueueEntry) -> bool:
        """Drop the worst-ranked swapped sequence (not `keep`) that holds device blocks back
        to waiting, to recompute; False when there is none."""
        for entry in reversed(self.queues.swapped):
            if entry is not keep and self.record_of(entry).num_device_blocks:
                self.queues.swapped.remove(entry)
                self.release_swapped(entry)
                self.queues.requeue_for_recompute(entry)
                self.stats.num_swapped_recomputed += 1
                return True
        return False

    def record_of(self, entry: QueueEntry) -> SwappedBlocks:
        record = self._records.get(entry.seq.request_id)
        if record is None:
            raise RuntimeError(f"{entry.seq.request_id}: swapped sequence without a record")
        return record

    def release_swapped(self, entry: QueueEntry) -> None:
        """Free the device and host blocks swapped `entry`'s record holds; drop the record."""
        release(self.record_of(entry), self.pool, _some_pool(self.host_pool))
        del self._records[entry.seq.request_id]

    @property
    def num_device_refs(self) -> int:
        """Device-pool references the swapped sequences' records hold."""
        return sum(self.record_of(e).num_device_blocks for e in self.queues.swapped)

    def check_integrity(self) -> None:
        """RuntimeError unless the records and the swap space agree on who holds which block."""
        if len(self._records) != len(self.queues.swapped):
            raise RuntimeError(f"integrity: {len(self._records)} records, swapped sequences differ")
        if self.host_pool is None:
            return
        self.host_pool.check_integrity()
        # NOTE: a host block the samples of one request share is one block, one reference
        # per record
        host = [h for e in self.queues.swapped for h in self.record_of(e).host if h is not None]
        if len(host) != self.host_pool.num_refs:
            raise RuntimeError(
                f"integrity: records hold {len(host)} host refs, swap space counts "
                f"{self.host_pool.num_refs}"
            )
        on_host = len(set(host))
        if on_host != self.host_pool.num_used:
            raise RuntimeError(
                f"integrity: records hold {on_host} host blocks, swap space uses "
                f"{self.host_pool.num_used}"
            )


def _some_pool(pool: BlockPool | None) -> BlockPool:
    if pool is None:
        raise RuntimeError("swap: no swap space configured")
    return pool
