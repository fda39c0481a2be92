"""`Scheduler`: continuous batching, priority preemption by swap or recompute (docs/scheduling.md).

Three queues, each sequence in exactly one::

    waiting  heap on rank        not started, or preempted by RECOMPUTE (holds no blocks)
    running  list                holds a device block table
    swapped  list sorted by rank preempted by SWAP (holds a `SwappedBlocks` record)

    rank = (priority, arrival)   under the `priority` policy (lower runs sooner)
    rank = (0, arrival)          under `fcfs`

`schedule()` decides one step with block ids and token counts only and returns a `DecodePlan`:

1. swap in the best-ranked swapped sequences that fit (seat, blocks for their host blocks and
   next token, leaving room for the running sequences' next tokens);
2. give every running sequence, best rank first, its next chunk (a decode token, or a prefill
   chunk under the token budget, shrunk to what fits). When blocks run out it preempts the
   worst-ranked running sequence (never one preempted `max_preemptions` times already),
   which may be itself;
3. admit waiting sequences, best rank first, with prefix-cache reuse and chunked prefill, while
   they outrank every swapped sequence; when seats or blocks run out, a waiting or swapped
   sequence displaces running ones only if it outranks them by `min_priority_gap` priority
   levels (never under `fcfs`), and only if displacing them is enough (ask, then commit).

The scheduler mutates sequences' tables, counters and statuses; the engine executes the plan and
hands the runner's output back to `update()`. docs/scheduling.md explains the choices.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedserve.decode_worker.plan import (
    DecodePlan,
    FailedSequence,
    KVPolicy,
    Preemption,
    PreemptionMode,
    SchedulerStats,
    SchedulingPolicy,
    SwapDirection,
)
from pagedserve.decode_worker.preemption import (
    PreemptionCostModel,
    SwappedBlocks,
    exclusive_positions,
    group_exclusive_blocks,
    release,
    swap_in_group,
    swap_in_group_cost,
    swap_out_group,
    trim_table,
)
from pagedserve.kvstore.block_pool import BlockId, BlockPool
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import RunnerOutput, SampledToken, ScheduledSequence
from pagedserve.model.requests.beam_search import (
    BeamSearch,
    hypothesis_finish_is_stop,
    new_beam_search,
)
from pagedserve.model.requests.progress import admit, advance
from pagedserve.model.requests.sequence import (
    FinishReason,
    RequestId,
    SampleGroup,
    Sequence,
    SequenceStatus,
    fork_samples,
)

Rank = tuple[int, int]
Pairs = list[tuple[BlockId, BlockId]]


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


@dataclass(slots=True, eq=False)
class _Entry:
    """The scheduler's private state of one sequence."""

    seq: Sequence
    rank: Rank
    num_preemptions: int = 0
    swapped: SwappedBlocks | None = None
    recompute_pending: bool = False  # preempted by RECOMPUTE and not re-admitted yet

    def __lt__(self, other: _Entry) -> bool:
        return self.rank < other.rank


@dataclass(slots=True)
class _Step:
    """One `schedule()` call in progress: the token budget left and what is scheduled so far."""

    plan: DecodePlan
    budget: int
    items: dict[RequestId, ScheduledSequence] = field(default_factory=dict)
    copies: dict[RequestId, Pairs] = field(default_factory=dict)

    def add(self, entry: _Entry, num_new_tokens: int, copies: Pairs) -> None:
        self.items[entry.seq.request_id] = ScheduledSequence(entry.seq, num_new_tokens)
        self.copies[entry.seq.request_id] = copies
        self.budget -= num_new_tokens

    def tokens_of(self, entry: _Entry) -> int:
        item = self.items.get(entry.seq.request_id)
        return item.num_new_tokens if item else 0

    def remove(self, entry: _Entry) -> Pairs:
        """Unschedule `entry` (a victim); return the copy-on-write pairs it had asked for."""
        self.budget += self.tokens_of(entry)
        self.items.pop(entry.seq.request_id, None)
        return self.copies.pop(entry.seq.request_id, [])

    def finish(self) -> DecodePlan:
        self.plan.scheduled = list(self.items.values())
        self.plan.copies = [pair for pairs in self.copies.values() for pair in pairs]
        return self.plan


class Scheduler:
    """Owns every sequence from `add` until it finishes or is aborted; frees each block once.

    `kv` is the device pool's manager; `host_pool` is the swap space's pool (None: no swap
    space, every preemption recomputes). Nothing here touches a tensor.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        host_pool: BlockPool | None = None,
        cost_model: PreemptionCostModel | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.pool = kv.pool
        self.host_pool = host_pool
        self.cost_model = cost_model or PreemptionCostModel()
        self.stats = SchedulerStats()
        self.waiting: list[_Entry] = []
        self.running: list[_Entry] = []
        self.swapped: list[_Entry] = []
        self._entries: dict[RequestId, _Entry] = {}
        self._failed: list[FailedSequence] = []
        self._arrivals = itertools.count()

    # -- queues --------------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self._entries or self._failed)

    def members_of(self, request_id: str) -> list[Sequence]:
        """The queued sequences of request `request_id`: its own, and its other samples'."""
        return [
            entry.seq
            for rid, entry in self._entries.items()
            if rid == request_id
            or (entry.seq.group is not None and entry.seq.group.request_id == request_id)
        ]

    def num_preemptions_of(self, request_id: str) -> int:
        entry = self._entries.get(RequestId(request_id))
        return entry.num_preemptions if entry else 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq` (fresh: no blocks, nothing computed).

        A sequence whose worst case cannot fit the whole device pool is finished at once with
        FinishReason.ERROR and reported in the next plan's `failed`. ValueError on a request
        id already in use.
        """
        if seq.request_id in self._entries:
            raise ValueError(f"request_id: {seq.request_id!r} is already queued")
        priority = seq.priority if self.config.policy is SchedulingPolicy.PRIORITY else 0
        entry = _Entry(seq, (priority, next(self._arrivals)))
        message = self._does_not_fit(seq)
        if message is not None:
            seq.finish(FinishReason.ERROR)
            self._failed.append(FailedSequence(seq, message))
            self.stats.num_failed += 1
            return
        seq.status = SequenceStatus.WAITING
        self._entries[seq.request_id] = entry
        heapq.heappush(self.waiting, entry)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue `seq` whose table already holds the KV of its first `num_computed_tokens`
        tokens (an imported prompt; its first output token appended, so it next decodes).

        It joins `running` when a seat is free. Otherwise its blocks are freed (full ones stay
        in the prefix cache) and it waits like a fresh sequence: admission reuses whatever the
        cache still holds and recomputes the rest. Fails like `add` when it can never fit.
        """
        if seq.request_id in self._entries:
            raise ValueError(f"request_id: {seq.request_id!r} is already queued")
        if len(self.running) >= self.config.max_num_seqs or self._does_not_fit(seq):
            self.kv.free(seq.block_table)
            seq.num_computed_tokens = 0
            self.add(seq)
            return
        priority = seq.priority if self.config.policy is SchedulingPolicy.PRIORITY else 0
        entry = _Entry(seq, (priority, next(self._arrivals)))
        seq.status = SequenceStatus.RUNNING
        self._entries[seq.request_id] = entry
        self.running.append(entry)

    def abort(self, request_id: str) -> bool:
        """Finish the request with ABORT and free its device and host blocks now.

        Returns False (changing nothing) for an unknown or already finished request, so
        blocks are freed exactly once however often abort is called.
        """
        # NOTE: the request's id ends every sample (each holds its own references), also
        # when sample 0 already finished
        found = [self.abort_one(seq.request_id) for seq in self.members_of(request_id)]
        return any(found)

    def abort_one(self, request_id: str) -> bool:
        """`abort` of the one sequence queued under `request_id` (a sample's own id)."""
        entry = self._entries.pop(RequestId(request_id), None)
        if entry is None:
            return False
        if entry in self.running:
            self.running.remove(entry)
            self.kv.free(entry.seq.block_table)
        elif entry in self.swapped:
            self.swapped.remove(entry)
            self._release_swapped(entry)
        else:
            self.waiting.remove(entry)
            heapq.heapify(self.waiting)
        entry.seq.finish(FinishReason.ABORT)
        return True

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> DecodePlan:
        """Decide the next step (see the module docstring). Mutates tables and queues."""
        plan = DecodePlan(failed=self._failed)
        self._failed = []
        step = _Step(plan, self.config.max_num_batched_tokens)
        self._swap_in_what_fits(step)
        for entry in sorted(self.running):
            if step.budget <= 0:
                break
            if entry in self.running:
                self._schedule_running(entry, step)
        self._admit_waiting(step)
        return step.finish()

    def update(self, plan: DecodePlan, output: RunnerOutput) -> list[Sequence]:
        """Apply the runner's results for `plan`; return the sequences that finished.

        Advances `num_computed_tokens`, offers full blocks to the prefix cache, appends each
        sampled token, checks the stop conditions and frees finished sequences' blocks.
        """
        finished: list[Sequence] = []
        beams: dict[RequestId, list[tuple[ScheduledSequence, SampledToken]]] = {}
        for item, sampled in zip(plan.scheduled, output.sampled, strict=True):
            seq = item.seq
            if sampled is not None and seq.params.use_beam_search:
                beams.setdefault(_request_of(seq), []).append((item, sampled))
                continue
            done = advance(
                self.kv,
                item,
                sampled,
                eos_token_ids=self.config.eos_token_ids,
                max_model_len=self.config.max_model_len,
            )
            if sampled is not None and seq.forks_pending:
                # NOTE: before the parent's blocks can be freed: the samples share them
                forks = [(token.token_id, token.logprobs) for token in sampled.forks]
                rank = self._entries[seq.request_id].rank
                finished += self._add_samples(rank, fork_samples(seq, forks))
            if done:
                entry = self._entries.pop(seq.request_id)
                self.running.remove(entry)
                self.kv.free(seq.block_table)
                finished.append(seq)
        for rows in beams.values():
            finished += self._beam_step(rows)
        return finished

    # -- beam search ---------------------------------------------------------------------------

    def add_beam_request(
        self, parent: Sequence, candidates: list[tuple[int, float]], *, prefilled: bool
    ) -> list[Sequence]:
        """Queue a beam-search request whose prompt's last logits the prefill worker already
        turned into `candidates` (token, logprob): the first beam step runs here, then the
        beams are forked from `parent` (its table holds the prompt's KV when `prefilled`).
        Returns the beams already finished (a search that ended at its first token)."""
        samples, done = self._first_beam_step(parent, candidates)
        rank = self._queue_parent(parent, samples, prefilled=prefilled)
        if rank is None:
            return samples
        return self._add_samples(rank, samples) + (self._finish_beams(parent) if done else [])

    def _first_beam_step(
        self, parent: Sequence, candidates: list[tuple[int, float]]
    ) -> tuple[list[Sequence], bool]:
        """Start `parent`'s search from the prompt's candidates: it takes the best beam's
        token; the other beams are forked from it. Returns them and whether the search ended."""
        limit = min(parent.params.max_tokens, self.config.max_model_len - parent.num_prompt_tokens)
        search = new_beam_search(parent.params, self.config.eos_token_ids, limit)
        step = search.step([candidates], [[]])
        parent.append_token(step.tokens[0], None)
        samples = fork_samples(parent, [(token, None) for token in step.tokens[1:]])
        _some_group(parent).beam = search
        return samples, step.done

    def _queue_parent(
        self, parent: Sequence, samples: list[Sequence], *, prefilled: bool
    ) -> Rank | None:
        """Queue sample 0 like `add_prefilled` or `add`; its rank, or None when it can never
        fit (its forked samples then fail with it, their blocks freed)."""
        (self.add_prefilled if prefilled else self.add)(parent)
        entry = self._entries.get(parent.request_id)
        if entry is not None:
            return entry.rank
        for seq in samples:
            self.kv.free(seq.block_table)
            seq.finish(FinishReason.ERROR)
        return None

    def _beam_step(self, rows: list[tuple[ScheduledSequence, SampledToken]]) -> list[Sequence]:
        """One beam-search step of a request whose beams (`rows`) completed a forward."""
        first = rows[0][0].seq
        if first.group is None:  # NOTE: the prompt's last row: the first step forks the beams
            item, sampled = rows[0]
            self._advance_computed(item, item.num_new_tokens)
            rank = self._entries[first.request_id].rank
            samples, done = self._first_beam_step(first, sampled.candidates)
            return self._add_samples(rank, samples) + (self._finish_beams(first) if done else [])
        group = _some_group(first)
        if len(rows) != len(group.members):
            # NOTE: not every beam ran (a budget, a seat, a recompute): the step waits for
            # them; the last token's KV is computed again with theirs
            for item, _ in rows:
                self._advance_computed(item, item.num_new_tokens - 1)
            return []
        rows = sorted(rows, key=lambda row: row[0].seq.sample_index)
        for item, _ in rows:
            self._advance_computed(item, item.num_new_tokens)
        members = [item.seq for item, _ in rows]
        step = _some_beam(group).step(
            [sampled.candidates for _, sampled in rows], [m.output_token_ids for m in members]
        )
        self._reassign_beams(members, step.parents, step.tokens)
        return self._finish_beams(first) if step.done else []

    def _advance_computed(self, item: ScheduledSequence, num_tokens: int) -> None:
        seq = item.seq
        seq.num_computed_tokens += num_tokens
        self.kv.cache_full_blocks(seq.block_table, seq.block_hashes, seq.num_computed_tokens)

    def _reassign_beams(
        self, members: list[Sequence], parents: list[int], tokens: list[int]
    ) -> None:
        """Beam j continues beam `parents[j]` with `tokens[j]`: its table becomes a fork of
        the parent's (sharing every block; the partial last block is copied on the next
        write), and blocks only dropped beams held are freed."""
        tables = [members[p].block_table.fork() for p in parents]
        olds = [(m.token_ids, m.block_hashes, m.num_computed_tokens) for m in members]
        for member in members:
            self.kv.free(member.block_table)
        for member, table, parent, token in zip(members, tables, parents, tokens, strict=True):
            token_ids, hashes, computed = olds[parent]
            member.block_table = table
            member.token_ids = [*token_ids, token]
            member.output_logprobs = [None] * member.num_output_tokens
            member.block_hashes = list(hashes)
            member.update_block_hashes()
            member.num_computed_tokens = computed

    def _finish_beams(self, beam: Sequence) -> list[Sequence]:
        """End `beam`'s search: beam i < n gets the i-th best finished hypothesis; every
        beam's blocks are freed. Returns every beam."""
        group = _some_group(beam)
        search = _some_beam(group)
        best = search.best(group.members[0].params.n)
        for member in group.members:
            entry = self._entries.pop(member.request_id, None)
            if entry is not None and entry in self.running:
                self.running.remove(entry)
                self.kv.free(member.block_table)
            elif entry is not None:
                self._drop_queued(entry)
            index = member.sample_index
            if index < len(best):
                hypothesis = best[index]
                member.token_ids = [*member.prompt_token_ids, *hypothesis.token_ids]
                member.output_logprobs = [None] * len(hypothesis.token_ids)
                stop = hypothesis_finish_is_stop(hypothesis, search.stop_ids)
                member.finish(FinishReason.STOP if stop else FinishReason.LENGTH)
            else:
                member.finish(FinishReason.STOP)
        return list(group.members)

    def _drop_queued(self, entry: _Entry) -> None:
        """Take a waiting or swapped entry out of its queue, freeing what it holds."""
        if entry in self.swapped:
            self.swapped.remove(entry)
            self._release_swapped(entry)
        elif entry in self.waiting:
            self.waiting.remove(entry)
            heapq.heapify(self.waiting)

    def add_samples(
        self, parent: Sequence, samples: list[Sequence], *, prefilled: bool
    ) -> list[Sequence]:
        """Queue a multi-sample request the caller forked (`fork_samples`): `parent` (sample 0)
        like `add_prefilled` (`prefilled`, its table holds the prompt's KV) or `add`, and its
        `samples` beside it, sharing the prompt's blocks. Returns the members already finished
        (by their first token, or failed with the parent), their blocks freed.
        """
        if parent.check_stop(self.config.eos_token_ids, self.config.max_model_len):
            self.kv.free(parent.block_table)  # NOTE: the samples hold their own references
            return [parent, *self._add_samples(self._rank(parent), samples)]
        rank = self._queue_parent(parent, samples, prefilled=prefilled)
        return samples if rank is None else self._add_samples(rank, samples)

    def _add_samples(self, rank: Rank, samples: list[Sequence]) -> list[Sequence]:
        """Queue forked samples: running (sharing the prompt's blocks) while seats last, else
        waiting with an empty table (they recompute, hitting the prefix cache). Returns those
        their first token already finished."""
        finished: list[Sequence] = []
        for seq in samples:
            if seq.request_id in self._entries:
                raise ValueError(f"request_id: {seq.request_id!r} is already queued")
            beam = seq.params.use_beam_search  # NOTE: the search decides when beams end
            if not beam and seq.check_stop(self.config.eos_token_ids, self.config.max_model_len):
                self.kv.free(seq.block_table)
                finished.append(seq)
                continue
            entry = _Entry(seq, rank)
            self._entries[seq.request_id] = entry
            if seq.block_table.block_ids and len(self.running) < self.config.max_num_seqs:
                seq.status = SequenceStatus.RUNNING
                self.running.append(entry)
            else:
                self.kv.free(seq.block_table)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
                heapq.heappush(self.waiting, entry)
        return finished

    def _rank(self, seq: Sequence) -> Rank:
        priority = seq.priority if self.config.policy is SchedulingPolicy.PRIORITY else 0
        return (priority, next(self._arrivals))

    # -- phase 1: swap in ----------------------------------------------------------------------

    def _swap_in_what_fits(self, step: _Step) -> None:
        while self.swapped and step.budget > 0:
            entry = self.swapped[0]
            if self._try_swap_in(entry, step):
                continue
            # NOTE: with nothing running, only other swapped sequences' shared device blocks
            # can be in the way; recompute them rather than wait forever.
            if self.running or not self._recompute_one_swapped(keep=entry):
                return

    def _try_swap_in(self, entry: _Entry, step: _Step) -> bool:
        """Swap in `entry` and every other swapped sample of its request, or none of them."""
        group = [entry, *self._swapped_mates(entry)]
        records = [_some_record(member) for member in group]
        cost = swap_in_group_cost(records, self.pool)
        # NOTE: leave room for the running sequences' next tokens, or phase 2 would preempt
        # the sequence just swapped in (it is often the worst-ranked one); samples sharing a
        # partial last block each copy it on their next token.
        need = cost + self._running_growth() + len(group) - 1
        for member, record in zip(group, records, strict=True):
            slots = self._slots_for(member.seq, record.num_tokens + 1)
            need += -(-slots // self.pool.block_size) - len(record.device)
        seat = len(self.running) + len(group) <= self.config.max_num_seqs
        if not (seat and need <= self.pool.num_allocatable) and not self._displace_for(
            entry, step, need, 1, len(group)
        ):
            return False
        tables = [member.seq.block_table for member in group]
        result = swap_in_group(records, tables, _some_pool(self.host_pool))
        if result is None:
            return False
        pairs, hits = result
        for member in group:
            self.swapped.remove(member)
            member.swapped = None
            member.seq.status = SequenceStatus.RUNNING
            self.running.append(member)
            step.plan.swapped_in.append(member.seq)
        step.plan.add_swaps(SwapDirection.IN, pairs)
        self.stats.num_swap_in_blocks += len(pairs)
        self.stats.num_swap_in_bytes += len(pairs) * self.config.bytes_per_block
        self.stats.num_swap_in_cache_hits += hits
        return True

    def _swapped_mates(self, entry: _Entry) -> list[_Entry]:
        group = entry.seq.group
        if group is None:
            return []
        mates = [self._entries.get(seq.request_id) for seq in group.members]
        return [m for m in mates if m is not None and m is not entry and m in self.swapped]

    def _running_growth(self) -> int:
        """Blocks the running sequences need for one more token each (a reserve)."""
        return sum(
            e.seq.block_table.blocks_needed(self._slots_for(e.seq, e.seq.num_computed_tokens + 1))
            for e in self.running
        )

    def _recompute_one_swapped(self, keep: _Entry) -> bool:
        for entry in reversed(self.swapped):
            if entry is not keep and _some_record(entry).num_device_blocks:
                self.swapped.remove(entry)
                self._release_swapped(entry)
                self._requeue_for_recompute(entry)
                self.stats.num_swapped_recomputed += 1
                return True
        return False

    # -- phase 2: running ----------------------------------------------------------------------

    def _schedule_running(self, entry: _Entry, step: _Step) -> None:
        seq = entry.seq
        want = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
        while True:
            n = self._tokens_that_fit(seq, want)
            if n > 0:
                slots = self._slots_for(seq, seq.num_computed_tokens + n)
                copies = self.kv.allocate(seq.block_table, slots)
                if copies is None:
                    raise RuntimeError(f"{seq.request_id}: allocation failed after it fit")
                step.add(entry, n, copies)
                return
            victim = next(self._victims_for_running(entry))
            self._preempt(victim, step)
            if victim is entry or entry not in self.running:
                return

    def _tokens_that_fit(self, seq: Sequence, want: int) -> int:
        """The largest chunk `<= want` whose slots the pool can give now (a shrunk prefill)."""
        table = seq.block_table
        capacity = (len(table.block_ids) + self.pool.num_allocatable) * self.pool.block_size
        n = min(want, capacity - seq.num_computed_tokens)
        if self.config.kv_policy is KVPolicy.RESERVE_MAX:
            # NOTE: the reservation covers any chunk up to the worst case: all or nothing.
            worst = self._slots_for(seq, seq.num_computed_tokens + max(n, 1))
            return max(n, 0) if self.kv.can_allocate(table, worst) else 0
        while n > 0 and not self.kv.can_allocate(table, seq.num_computed_tokens + n):
            n -= 1
        return max(n, 0)

    def _slots_for(self, seq: Sequence, num_tokens_total: int) -> int:
        """Slots `seq` must hold to compute up to `num_tokens_total` tokens under the policy."""
        if self.config.kv_policy is KVPolicy.RESERVE_MAX:
            return max(num_tokens_total, self._worst_case_tokens(seq))
        return num_tokens_total

    def _worst_case_tokens(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    def _victims_for_running(self, needy: _Entry) -> Iterator[_Entry]:
        """Worst-ranked running sequences ranked below `needy`, then `needy` itself."""
        for candidate in sorted(self.running, reverse=True):
            if candidate is needy:
                break
            if candidate.num_preemptions < self.config.max_preemptions:
                yield candidate
        yield needy

    # -- phase 3: waiting ----------------------------------------------------------------------

    def _admit_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0:
            entry = self.waiting[0]
            if self.swapped and not entry.rank < self.swapped[0].rank:
                return
            if not self._try_admit(entry, step):
                return
            heapq.heappop(self.waiting)

    def _try_admit(self, entry: _Entry, step: _Step) -> bool:
        seq, budget = entry.seq, step.budget
        need = self._admission_need(seq, budget)
        seat = len(self.running) < self.config.max_num_seqs
        if not (seat and need <= self.pool.num_allocatable) and not self._displace_for(
            entry, step, need, 1
        ):
            return False
        admitted = admit(self.kv, seq, budget, prefix_caching=self.kv.enable_prefix_caching)
        if admitted is None:
            return False
        item, copies = admitted
        if self.config.kv_policy is KVPolicy.RESERVE_MAX:
            reserved = self.kv.allocate(seq.block_table, self._slots_for(seq, seq.num_tokens))
            if reserved is None:
                raise RuntimeError(f"{seq.request_id}: reservation failed after it fit")
            copies += reserved
        if entry.recompute_pending:
            step.plan.recomputed.append(seq)
        entry.recompute_pending = False
        self.running.append(entry)
        step.add(entry, item.num_new_tokens, copies)
        return True

    def _match_prefix(self, seq: Sequence) -> list[BlockId]:
        return self.kv.match_prefix(seq.block_hashes, (seq.num_tokens - 1) // self.pool.block_size)

    def _admission_need(self, seq: Sequence, budget: int) -> int:
        """Allocatable blocks admitting `seq` with a chunk of at most `budget` tokens takes."""
        prefix = self._match_prefix(seq)
        num_cached = len(prefix) * self.pool.block_size
        n = min(seq.num_tokens - num_cached, max(budget, 1))
        revived = sum(self.pool.ref_count(b) == 0 for b in prefix)
        slots = self._slots_for(seq, num_cached + n)
        return -(-slots // self.pool.block_size) - len(prefix) + revived

    # -- displacing running sequences (phases 1 and 3) -----------------------------------------

    def _displace_for(
        self, entry: _Entry, step: _Step, need_blocks: int, need_tokens: int, need_seats: int = 1
    ) -> bool:
        """Preempt running sequences `entry` may displace until it has `need_seats` seats,
        `need_blocks` allocatable blocks and `need_tokens` of budget; preempt nobody if that
        is impossible."""
        seats = self.config.max_num_seqs - len(self.running) - (need_seats - 1)
        blocks, budget = self.pool.num_allocatable, step.budget
        victims: list[_Entry] = []
        for candidate in sorted(self.running, reverse=True):
            if seats >= 1 and blocks >= need_blocks and budget >= need_tokens:
                break
            if not self._outranks(entry, candidate):
                break
            if candidate.num_preemptions >= self.config.max_preemptions:
                continue
            victims.append(candidate)
            seats += 1
            blocks += len(exclusive_positions(candidate.seq.block_table))
            budget += step.tokens_of(candidate)
        if not (seats >= 1 and blocks >= need_blocks and budget >= need_tokens):
            return False
        for victim in victims:
            if victim in self.running:  # NOTE: not already preempted with a sample of its group
                self._preempt(victim, step)
        return True

    def _outranks(self, entry: _Entry, running: _Entry) -> bool:
        if self.config.policy is SchedulingPolicy.FCFS:
            return False
        return running.seq.priority - entry.seq.priority >= self.config.min_priority_gap

    # -- preemption ----------------------------------------------------------------------------

    def _preempt(self, entry: _Entry, step: _Step) -> None:
        """Take `entry` out of the running set by swap or recompute (see `_choose_mode`), and
        with it every other running sample of its request: a group is preempted as one unit,
        all swapped (each block only the group holds copied once) or all recomputed."""
        members = [entry, *self._running_mates(entry)]
        had_copies = False
        for member in members:
            had_copies |= bool(step.remove(member))
            trim_table(member.seq.block_table, member.seq.num_computed_tokens)
            self.running.remove(member)
            member.num_preemptions += 1
        seqs = [member.seq for member in members]
        if self._choose_mode(seqs, force_recompute=had_copies) is PreemptionMode.SWAP:
            result = swap_out_group(
                [seq.block_table for seq in seqs],
                [seq.block_hashes for seq in seqs],
                _some_pool(self.host_pool),
            )
            if result is not None:
                records, pairs = result
                for k, (member, record) in enumerate(zip(members, records, strict=True)):
                    self._enter_swapped(member, record, pairs if k == 0 else [], step)
                return
        for member in members:
            seq = member.seq
            num_blocks = len(seq.block_table.block_ids)
            self.kv.free(seq.block_table)
            self._requeue_for_recompute(member)
            self.stats.num_preemptions_recompute += 1
            step.plan.preempted.append(Preemption(seq, PreemptionMode.RECOMPUTE, num_blocks))

    def _running_mates(self, entry: _Entry) -> list[_Entry]:
        """The other running samples of `entry`'s request, worst-ranked first."""
        group = entry.seq.group
        if group is None:
            return []
        mates = [self._entries.get(seq.request_id) for seq in group.members]
        return [
            m for m in reversed(mates) if m is not None and m is not entry and m in self.running
        ]

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

    def _enter_swapped(
        self, entry: _Entry, record: SwappedBlocks, pairs: Pairs, step: _Step
    ) -> None:
        entry.swapped = record
        entry.seq.status = SequenceStatus.SWAPPED
        self.swapped.append(entry)
        self.swapped.sort()
        step.plan.add_swaps(SwapDirection.OUT, pairs)
        step.plan.preempted.append(Preemption(entry.seq, PreemptionMode.SWAP, len(pairs)))
        self.stats.num_preemptions_swap += 1
        self.stats.num_swap_out_blocks += len(pairs)
        self.stats.num_swap_out_bytes += len(pairs) * self.config.bytes_per_block

    def _requeue_for_recompute(self, entry: _Entry) -> None:
        """Back to waiting with nothing computed; prompt + generated tokens are recomputed."""
        entry.seq.num_computed_tokens = 0
        entry.seq.status = SequenceStatus.WAITING
        entry.recompute_pending = True
        heapq.heappush(self.waiting, entry)

    def _release_swapped(self, entry: _Entry) -> None:
        release(_some_record(entry), self.pool, _some_pool(self.host_pool))
        entry.swapped = None

    # -- checks --------------------------------------------------------------------------------

    @property
    def num_block_refs(self) -> int:
        """Device-pool references the queued sequences hold (running tables, swapped records)."""
        refs = sum(len(e.seq.block_table.block_ids) for e in self.running)
        return refs + sum(_some_record(e).num_device_blocks for e in self.swapped)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless queues and pools agree on who holds which block."""
        self.pool.check_integrity()
        queued = [*self.waiting, *self.running, *self.swapped]
        if len(queued) != len(set(map(id, queued))) or len(queued) != len(self._entries):
            raise RuntimeError(
                f"integrity: {len(self._entries)} sequences, queues hold {len(queued)} entries"
            )
        device_refs = self.num_block_refs
        held = self.pool.num_refs
        if device_refs != held:
            raise RuntimeError(f"integrity: sequences hold {device_refs} refs, pool counts {held}")
        if any(e.seq.block_table.block_ids for e in (*self.waiting, *self.swapped)):
            raise RuntimeError("integrity: a waiting or swapped sequence holds a block table")
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            # NOTE: a host block the samples of one request share is one block, one
            # reference per record
            host = [h for e in self.swapped for h in _some_record(e).host if h is not None]
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

    def _does_not_fit(self, seq: Sequence) -> str | None:
        worst = min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)
        samples = seq.params.num_samples if seq.sample_index == 0 else 1
        blocks = worst_case_blocks(seq.num_prompt_tokens, worst, self.pool.block_size, samples)
        if blocks <= self.pool.num_blocks:
            return None
        return (
            f"request needs up to {worst} tokens per sample ({blocks} KV blocks of "
            f"{self.pool.block_size}) but this decode worker's KV cache holds only "
            f"{self.pool.num_blocks} blocks; lower max_tokens or use a larger worker"
        )


def worst_case_blocks(prompt_tokens: int, worst_tokens: int, block_size: int, samples: int) -> int:
    """Blocks a request of `samples` samples holds at most: the prompt's full blocks once
    (shared), each sample's own blocks past them (its copy of a partial last block included)."""
    shared = prompt_tokens // block_size
    return shared + samples * (-(-worst_tokens // block_size) - shared)


def _request_of(seq: Sequence) -> RequestId:
    return seq.group.request_id if seq.group is not None else seq.request_id


def _some_group(seq: Sequence) -> SampleGroup:
    if seq.group is None:
        raise RuntimeError(f"{seq.request_id}: not forked into samples")
    return seq.group


def _some_beam(group: SampleGroup) -> BeamSearch:
    if group.beam is None:
        raise RuntimeError(f"{group.request_id}: not a beam search")
    return group.beam


def _some_record(entry: _Entry) -> SwappedBlocks:
    if entry.swapped is None:
        raise RuntimeError(f"{entry.seq.request_id}: swapped sequence without a record")
    return entry.swapped


def _some_pool(pool: BlockPool | None) -> BlockPool:
    if pool is None:
        raise RuntimeError("swap: no swap space configured")
    return pool
