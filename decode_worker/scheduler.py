"""`Scheduler`: continuous batching, priority preemption by swap or recompute (docs/scheduling.md).

The queues (waiting, running, swapped; ranked by priority and arrival) are described in
queues.py. `schedule()` decides one step with block ids and token counts only and returns a
`DecodePlan`:

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

The scheduler decides admission and order; the `Preemptor` (preemption.py) chooses victims and
carries out swaps and recomputes; `SampleGroups` and `BeamGroups` (groups.py) queue and step
requests that run as several sequences. They mutate sequences' tables, counters and statuses;
the engine executes the plan and hands the runner's output back to `update()`.
docs/scheduling.md explains the choices.
"""

from __future__ import annotations

from pagedserve.decode_worker.groups import BeamGroups, BeamRows, SampleGroups, group_of
from pagedserve.decode_worker.plan import (
    DecodePlan,
    FailedSequence,
    KVPolicy,
    SchedulerConfig,
    SchedulerStats,
)
from pagedserve.decode_worker.preemption import (
    PreemptionCostModel,
    Preemptor,
    SwappedBlocks,
    swap_in_group_cost,
)
from pagedserve.decode_worker.queues import Pairs, PlanDraft, QueueEntry, Rank, SequenceQueues
from pagedserve.decode_worker.speculation import SpeculativeConfig, Speculator
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import RunnerOutput, SampledToken, ScheduledSequence
from pagedserve.model.requests.progress import admit, advance
from pagedserve.model.requests.sequence import FinishReason, RequestId, Sequence


class Scheduler:
    """Owns every sequence from `add` until it finishes or is aborted; frees each block once.

    `kv` is the device pool's manager; `host_pool` is the swap space's pool (None: no swap
    space, every preemption recomputes). Nothing here touches a tensor. A sequence leaves the
    queues through `_discard` only, which frees what it holds.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        host_pool: BlockPool | None = None,
        cost_model: PreemptionCostModel | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.speculator = Speculator(speculative) if speculative is not None else None
        self.kv = kv
        self.pool = kv.pool
        self.host_pool = host_pool
        self.cost_model = cost_model or PreemptionCostModel()
        self.stats = SchedulerStats()
        self.queues = queues = SequenceQueues(config.policy)
        # NOTE: the queues' own lists, never replaced (read by the engine, worker and tests)
        self.waiting, self.running, self.swapped = queues.waiting, queues.running, queues.swapped
        self.needs = BlockNeeds(config, kv)
        self.preemptor = Preemptor(config, kv, host_pool, self.queues, self.cost_model, self.stats)
        self.samples = SampleGroups(config, kv, self.queues)
        self.beams = BeamGroups(config, kv, self.samples)
        self._failed: list[FailedSequence] = []

    # -- queues --------------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self.queues.entries or self._failed)

    def members_of(self, request_id: str) -> list[Sequence]:
        """The queued sequences of request `request_id`: its own, and its other samples'."""
        return self.queues.members_of(request_id)

    def num_preemptions_of(self, request_id: str) -> int:
        entry = self.queues.entries.get(RequestId(request_id))
        return entry.num_preemptions if entry else 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq` (fresh: no blocks, nothing computed).

        A sequence whose worst case cannot fit the whole device pool is finished at once with
        FinishReason.ERROR and reported in the next plan's `failed`. ValueError on a request
        id already in use.
        """
        self.queues.check_unused(seq)
        rank = self.queues.new_rank(seq)
        message = self.needs.does_not_fit(seq)
        if message is not None:
            seq.finish(FinishReason.ERROR)
            self._failed.append(FailedSequence(seq, message))
            self.stats.num_failed += 1
            return
        self.queues.push_waiting(self.queues.register(seq, rank))

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue `seq` whose table already holds the KV of its first `num_computed_tokens`
        tokens (an imported prompt; its first output token appended, so it next decodes).

        It joins `running` when a seat is free. Otherwise its blocks are freed (full ones stay
        in the prefix cache) and it waits like a fresh sequence: admission reuses whatever the
        cache still holds and recomputes the rest. Fails like `add` when it can never fit.
        """
        self.queues.check_unused(seq)
        if len(self.running) >= self.config.max_num_seqs or self.needs.does_not_fit(seq):
            self.kv.free(seq.block_table)
            seq.num_computed_tokens = 0
            self.add(seq)
            return
        rank = self.queues.new_rank(seq)
        self.queues.push_running(self.queues.register(seq, rank))

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
            return [parent, *self.samples.add(self.queues.new_rank(parent), samples)]
        rank = self._queue_parent(parent, samples, prefilled=prefilled)
        return samples if rank is None else self.samples.add(rank, samples)

    def add_beam_request(
        self, parent: Sequence, candidates: list[tuple[int, float]], *, prefilled: bool
    ) -> list[Sequence]:
        """Queue a beam-search request whose prompt's last logits the prefill worker already
        turned into `candidates` (token, logprob): the first beam step runs here, then the
        beams are forked from `parent` (its table holds the prompt's KV when `prefilled`).
        Returns the beams already finished (a search that ended at its first token)."""
        samples, done = self.beams.start(parent, candidates)
        rank = self._queue_parent(parent, samples, prefilled=prefilled)
        if rank is None:
            return samples
        return self.samples.add(rank, samples) + (self._end_search(parent) if done else [])

    def _queue_parent(
        self, parent: Sequence, samples: list[Sequence], *, prefilled: bool
    ) -> Rank | None:
        """Queue sample 0 like `add_prefilled` or `add`; its rank, or None when it can never
        fit (its forked samples then fail with it, their blocks freed)."""
        (self.add_prefilled if prefilled else self.add)(parent)
        entry = self.queues.entries.get(parent.request_id)
        if entry is not None:
            return entry.rank
        for seq in samples:
            self.kv.free(seq.block_table)
            seq.finish(FinishReason.ERROR)
        return None

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
        entry = self.queues.entries.get(RequestId(request_id))
        if entry is None:
            return False
        self._discard(entry)
        entry.seq.finish(FinishReason.ABORT)
        return True

    def _discard(self, entry: QueueEntry) -> None:
        """Take `entry` out of the queues, freeing what it holds (table or swap record)."""
        if entry in self.running:
            self.kv.free(entry.seq.block_table)
        elif entry in self.swapped:
            self.preemptor.release_swapped(entry)
        self.queues.forget(entry)
        if self.speculator is not None:
            self.speculator.forget(entry.seq.request_id)

    def _end_search(self, beam: Sequence) -> list[Sequence]:
        """Take every beam of `beam`'s search out of the queues, then finish them."""
        for member in group_of(beam).members:
            entry = self.queues.entries.get(member.request_id)
            if entry is not None:
                self._discard(entry)
        return self.beams.finish(beam)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> DecodePlan:
        """Decide the next step (see the module docstring). Mutates tables and queues."""
        plan = DecodePlan(failed=self._failed)
        self._failed = []
        draft = PlanDraft(plan, self.config.max_num_batched_tokens)
        self._swap_in_what_fits(draft)
        for entry in sorted(self.running):
            if draft.budget <= 0:
                break
            if entry in self.running:
                self._schedule_running(entry, draft)
        self._admit_waiting(draft)
        self._speculate(draft)
        return draft.finish()

    def update(self, plan: DecodePlan, output: RunnerOutput) -> list[Sequence]:
        """Apply the runner's results for `plan`; return the sequences that finished.

        Advances `num_computed_tokens`, offers full blocks to the prefix cache, appends each
        sampled token, checks the stop conditions and frees finished sequences' blocks.
        """
        finished: list[Sequence] = []
        beams: dict[RequestId, BeamRows] = {}
        for i, (item, sampled) in enumerate(zip(plan.scheduled, output.sampled, strict=True)):
            seq = item.seq
            if sampled is not None and seq.params.use_beam_search:
                beams.setdefault(_request_of(seq), []).append((item, sampled))
                continue
            eos, max_len = self.config.eos_token_ids, self.config.max_model_len
            done = advance(self.kv, item, sampled, eos_token_ids=eos, max_model_len=max_len,
                           prompt_logprobs=output.prompt_logprobs_of(i))  # fmt: skip
            if item.draft:
                self._end_verification(item, sampled, done)
            if sampled is not None and seq.forks_pending:
                finished += self.samples.fork(seq, sampled)
            if done:
                self._discard(self.queues.entries[seq.request_id])
                finished.append(seq)
        for rows in beams.values():
            forked, done = self.beams.step(rows)
            finished += forked + (self._end_search(rows[0][0].seq) if done else [])
        return finished

    # -- phase 4: speculation -----------------------------------------------------------------

    def _speculate(self, draft: PlanDraft) -> None:
        """Give running decode chunks proposals to verify, best rank first, in what is left of
        the token budget and of the pool's allocatable blocks: never a preemption for them."""
        if self.speculator is None or len(self.running) > self.speculator.config.max_batch:
            return
        for entry in sorted(self.running):
            item = draft.items.get(entry.seq.request_id)
            if draft.budget <= 0 or item is None or not item.completes or item.num_new_tokens > 1:
                continue
            room = min(draft.budget, self._tokens_left(item.seq) - 1)
            proposal = self.speculator.propose(item.seq, room)
            copies = self._draft_slots(item.seq, proposal)
            if copies is not None:
                draft.add_draft(item, proposal, copies)

    def _draft_slots(self, seq: Sequence, proposal: list[int]) -> Pairs | None:
        """Allocate slots for as many of `proposal` as fit (popping the rest); None for none."""
        while proposal:
            slots = self.needs.slots_for(seq, seq.num_tokens + len(proposal))
            if self.kv.can_allocate(seq.block_table, slots):
                copies = self.kv.allocate(seq.block_table, slots)
                if copies is None:
                    raise RuntimeError(f"{seq.request_id}: allocation failed after it fit")
                return copies
            proposal.pop()
        return None

    def _tokens_left(self, seq: Sequence) -> int:
        """Output tokens `seq` may still produce (max_tokens, the model's length)."""
        return min(seq.params.max_tokens - seq.num_output_tokens,
                   self.config.max_model_len - seq.num_tokens)  # fmt: skip

    def _end_verification(self, item: ScheduledSequence, sampled: SampledToken | None,
                          done: bool) -> None:  # fmt: skip
        """Count a verification and drop the slots of the proposals it rejected."""
        if self.speculator is None or sampled is None:
            raise RuntimeError(f"{item.seq.request_id}: a verification without a speculator")
        self.speculator.observe(item.seq, len(item.draft), sampled.num_accepted)
        if not done:  # NOTE: under reserve-max the reservation stays
            seq = item.seq
            seq.block_table.truncate(self.needs.slots_for(seq, seq.num_computed_tokens))

    # -- phase 1: swap in ----------------------------------------------------------------------

    def _swap_in_what_fits(self, draft: PlanDraft) -> None:
        while self.swapped and draft.budget > 0:
            entry = self.swapped[0]
            if self._try_swap_in(entry, draft):
                continue
            # NOTE: with nothing running, only other swapped sequences' shared device blocks
            # can be in the way; recompute them rather than wait forever.
            if self.running or not self.preemptor.recompute_one_swapped(keep=entry):
                return

    def _try_swap_in(self, entry: QueueEntry, draft: PlanDraft) -> bool:
        """Swap in `entry` and every other swapped sample of its request, or none of them."""
        group = [entry, *self.queues.mates(entry, self.swapped)]
        records = [self.preemptor.record_of(member) for member in group]
        need = self.needs.swap_in_need([m.seq for m in group], records, self.running)
        seat = len(self.running) + len(group) <= self.config.max_num_seqs
        if not (seat and need <= self.pool.num_allocatable) and not self.preemptor.displace_for(
            entry, draft, need, 1, len(group)
        ):
            return False
        return self.preemptor.swap_in(group, draft)

    # -- phase 2: running ----------------------------------------------------------------------

    def _schedule_running(self, entry: QueueEntry, draft: PlanDraft) -> None:
        seq = entry.seq
        want = min(seq.num_tokens - seq.num_computed_tokens, draft.budget)
        while True:
            n = self.needs.tokens_that_fit(seq, want)
            if n > 0:
                slots = self.needs.slots_for(seq, seq.num_computed_tokens + n)
                copies = self.kv.allocate(seq.block_table, slots)
                if copies is None:
                    raise RuntimeError(f"{seq.request_id}: allocation failed after it fit")
                draft.add(entry, n, copies)
                return
            victim = next(self.preemptor.victims_for_running(entry))
            self.preemptor.preempt(victim, draft)
            if victim is entry or entry not in self.running:
                return

    # -- phase 3: waiting ----------------------------------------------------------------------

    def _admit_waiting(self, draft: PlanDraft) -> None:
        while self.waiting and draft.budget > 0:
            entry = self.waiting[0]
            if self.swapped and not entry.rank < self.swapped[0].rank:
                return
            if not self._try_admit(entry, draft):
                return
            self.queues.pop_waiting()

    def _try_admit(self, entry: QueueEntry, draft: PlanDraft) -> bool:
        seq, budget = entry.seq, draft.budget
        need = self.needs.admission_need(seq, budget)
        seat = len(self.running) < self.config.max_num_seqs
        if not (seat and need <= self.pool.num_allocatable) and not self.preemptor.displace_for(
            entry, draft, need, 1
        ):
            return False
        admitted = admit(self.kv, seq, budget, prefix_caching=self.kv.enable_prefix_caching)
        if admitted is None:
            return False
        item, copies = admitted
        if self.config.kv_policy is KVPolicy.RESERVE_MAX:
            reserved = self.kv.allocate(seq.block_table, self.needs.slots_for(seq, seq.num_tokens))
            if reserved is None:
                raise RuntimeError(f"{seq.request_id}: reservation failed after it fit")
            copies += reserved
        if entry.recompute_pending:
            draft.plan.recomputed.append(seq)
        entry.recompute_pending = False
        self.running.append(entry)  # NOTE: `admit` marked it RUNNING
        draft.add(entry, item.num_new_tokens, copies)
        return True

    # -- checks --------------------------------------------------------------------------------

    @property
    def num_block_refs(self) -> int:
        """Device-pool references the queued sequences hold (running tables, swapped records)."""
        refs = sum(len(e.seq.block_table.block_ids) for e in self.running)
        return refs + self.preemptor.num_device_refs

    def check_integrity(self) -> None:
        """Raise RuntimeError unless queues and pools agree on who holds which block."""
        self.pool.check_integrity()
        self.queues.check_integrity()
        device_refs = self.num_block_refs
        held = self.pool.num_refs
        if device_refs != held:
            raise RuntimeError(f"integrity: sequences hold {device_refs} refs, pool counts {held}")
        self.preemptor.check_integrity()


class BlockNeeds:
    """What sequences need of the device pool under the KV policy, and what fits now. Asks
    only: changes nothing (the scheduler commits)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.pool = kv.pool

    def slots_for(self, seq: Sequence, num_tokens_total: int) -> int:
        """Slots `seq` must hold to compute up to `num_tokens_total` tokens under the policy."""
        if self.config.kv_policy is KVPolicy.RESERVE_MAX:
            return max(num_tokens_total, self._worst_case_tokens(seq))
        return num_tokens_total

    def _worst_case_tokens(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    def tokens_that_fit(self, seq: Sequence, want: int) -> int:
        """The largest chunk `<= want` whose slots the pool can give now (a shrunk prefill)."""
        table = seq.block_table
        capacity = (len(table.block_ids) + self.pool.num_allocatable) * self.pool.block_size
        n = min(want, capacity - seq.num_computed_tokens)
        if self.config.kv_policy is KVPolicy.RESERVE_MAX:
            # NOTE: the reservation covers any chunk up to the worst case: all or nothing.
            worst = self.slots_for(seq, seq.num_computed_tokens + max(n, 1))
            return max(n, 0) if self.kv.can_allocate(table, worst) else 0
        while n > 0 and not self.kv.can_allocate(table, seq.num_computed_tokens + n):
            n -= 1
        return max(n, 0)

    def admission_need(self, seq: Sequence, budget: int) -> int:
        """Allocatable blocks admitting `seq` with a chunk of at most `budget` tokens takes."""
        max_blocks = (seq.num_tokens - 1) // self.pool.block_size
        if seq.wants_prompt_logprobs:  # NOTE: `admit` takes no hit for it either
            max_blocks = 0
        prefix = self.kv.match_prefix(seq.block_hashes, max_blocks)
        num_cached = len(prefix) * self.pool.block_size
        n = min(seq.num_tokens - num_cached, max(budget, 1))
        revived = sum(self.pool.ref_count(b) == 0 for b in prefix)
        slots = self.slots_for(seq, num_cached + n)
        return -(-slots // self.pool.block_size) - len(prefix) + revived

    def swap_in_need(
        self, seqs: list[Sequence], records: list[SwappedBlocks], running: list[QueueEntry]
    ) -> int:
        """Allocatable blocks swapping `seqs` (their `records`) in together takes, with room
        for one more token of each of them and of each `running` sequence."""
        # NOTE: leave room for the running sequences' next tokens, or phase 2 would preempt
        # the sequence just swapped in (it is often the worst-ranked one); samples sharing a
        # partial last block each copy it on their next token.
        need = swap_in_group_cost(records, self.pool) + self._growth(running) + len(seqs) - 1
        for seq, record in zip(seqs, records, strict=True):
            slots = self.slots_for(seq, record.num_tokens + 1)
            need += -(-slots // self.pool.block_size) - len(record.device)
        return need

    def _growth(self, running: list[QueueEntry]) -> int:
        """Blocks the `running` sequences need for one more token each (a reserve)."""
        return sum(
            e.seq.block_table.blocks_needed(self.slots_for(e.seq, e.seq.num_computed_tokens + 1))
            for e in running
        )

    def does_not_fit(self, seq: Sequence) -> str | None:
        """Why `seq`'s worst case can never fit the whole device pool; None when it can."""
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
