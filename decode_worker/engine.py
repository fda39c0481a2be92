"""`DecodeEngine`: the decode worker's in-process loop: Scheduler + ModelRunner + Swapper.

One `step()`::

    plan = scheduler.schedule()                      block ids and token counts only
    swapper.submit_plan(plan.swaps)                  async, in decision order: copy thread / stream
    swapper.wait_for_writes(blocks this step writes) only if a pending swap-out reads one
    swapper.wait_swap_in()                           swapped-in blocks land before the forward
    runner.copy_blocks(plan.copies); runner.execute(plan.scheduled)
    scheduler.update(plan, output)                   tokens, stops, frees

It is the one generation loop in pagedserve: `DecodeWorker` (worker.py) drives it from one loop
thread and feeds it imported prompts (kv_import.py, docs/leases.md) through `add_prefilled`;
`pagedserve generate --model`, the oracle tests and the in-process benchmark peer call
`add_request` / `generate` / `step` directly.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedserve.decode_worker.plan import (
    DecodePlan,
    KVPolicy,
    PreemptionMode,
    SchedulerConfig,
    SchedulerStats,
    SchedulingPolicy,
    SwapDirection,
)
from pagedserve.decode_worker.preemption import PreemptionCostModel
from pagedserve.decode_worker.scheduler import Scheduler, worst_case_blocks
from pagedserve.decode_worker.speculation import SpeculationStats, SpeculativeConfig
from pagedserve.decode_worker.swapper import CopyFn, Swapper, every_rank
from pagedserve.kvstore.block_pool import BlockEvent, BlockPool
from pagedserve.kvstore.eviction import DEFAULT_EVICTION_POLICY, EvictionPolicy
from pagedserve.kvstore.kv_offload import check_offload_config, kv_cache_manager
from pagedserve.kvstore.swap_space import SwapSpace, swap_blocks_for
from pagedserve.model import tp_ranks
from pagedserve.model.config import ModelConfig, load_model_config, model_len
from pagedserve.model.draft import DraftModel, ModelProposer, fill_drafts, settle_drafts
from pagedserve.model.loader import load_model
from pagedserve.model.quant import WeightQuant
from pagedserve.model.requests.batch import RunnerOutput
from pagedserve.model.requests.sequence import RequestId, Sequence, make_sequence
from pagedserve.model.runner import ModelRunner, kv_cache_spec
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DecodeEngineConfig:
    """The pool, batch limits, model and device of one engine (the fields the prefill engine's
    config shares: engine_sizing.EngineFields), its swap space, preemption and scheduling
    policy. Validated once, here."""

    block_size: int = 16
    num_blocks: int = 512
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    eviction_policy: EvictionPolicy = DEFAULT_EVICTION_POLICY  # which cached block goes first
    kv_offload_blocks: int = 0  # host-memory prefix tier (--kv-offload-memory), 0: off
    kv_offload_dir: str | None = None  # disk prefix tier below it (--kv-offload-dir), None: off
    kv_offload_disk_bytes: int = 0  # its size (--kv-offload-disk)
    dtype: str | None = None  # default: the checkpoint's
    quantization: WeightQuant | None = None  # of the linear layers' weights (model/quant.py)
    kv_cache_dtype: str | None = None  # "int8" / "fp8_e4m3" for an 8-bit KV cache; None: dtype's
    device: str = "cpu"
    tensor_parallel_size: int = 1  # rank processes holding a shard each (model/tp_ranks.py)
    swap_space_gib: float = 4.0
    num_swap_blocks: int | None = None  # overrides swap_space_gib (tests size it in blocks)
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.PRIORITY
    kv_policy: KVPolicy = KVPolicy.PAGED
    min_priority_gap: int = 1
    max_preemptions: int = 4
    # The preemption cost model's prior; `measure_costs` refines it from measured speeds.
    swap_bytes_per_s: float = 10e9
    prefill_tokens_per_s: float = 8e3
    swap_overhead_s: float = 2e-4
    measure_costs: bool = True
    speculative: SpeculativeConfig | None = None  # speculative decoding (speculation.py)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
                     "tensor_parallel_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib: must be >= 0, got {self.swap_space_gib}")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks: must be >= 0, got {self.num_swap_blocks}")
        check_offload_config(
            self.kv_offload_blocks,
            self.tensor_parallel_size,
            self.kv_offload_dir,
            self.kv_offload_disk_bytes,
        )
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative-method: speculative decoding is not supported with "
                "--tensor-parallel-size above 1"
            )

    def cost_model(self) -> PreemptionCostModel:
        return PreemptionCostModel(
            swap_bytes_per_s=self.swap_bytes_per_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            swap_overhead_s=self.swap_overhead_s,
            measure=self.measure_costs,
        )


@dataclass(slots=True)
class DecodeStepOutput:
    plan: DecodePlan
    finished: list[Sequence] = field(default_factory=list)  # incl. plan.failed's sequences
    waited_for_swap_out: bool = False
    # the pool's block events since the last step (this step's, and KV imports' since)
    events: list[BlockEvent] = field(default_factory=list)


class DecodeEngine:
    """Owns sequences from `add_request` until they finish; frees their blocks exactly once.

    Not thread-safe: call `add_request`, `step` and `abort` from one thread (the servicer's
    engine loop). `close()` waits for in-flight swap copies and stops the copy thread.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        runner: ModelRunner,
        config: DecodeEngineConfig,
        *,
        copy_fn: CopyFn | None = None,
        revision: str = "",
        draft: ModelProposer | None = None,
    ) -> None:
        """`draft`: the draft model of `config.speculative`'s draft method (its KV cache has
        this engine's block count and size, see model/draft.py)."""
        self.model_config = model_config
        self.draft = draft
        self.config = config
        self.runner = runner
        self.max_model_len = model_len(model_config, config.max_model_len)
        # NOTE: computed exactly as the prefill worker does, so block hashes and the layout
        # compat hash agree across the two (docs/hashing.md).
        self.fingerprint = model_config.fingerprint(revision)
        # NOTE: the pool records block events for the prefix index; every `step` drains them
        self.pool = BlockPool(
            config.num_blocks,
            config.block_size,
            eviction_policy=config.eviction_policy,
        )
        self.kv = kv_cache_manager(
            self.pool, runner.spec, runner.kv_cache.tensor, config, self.fingerprint
        )
        num_swap = config.num_swap_blocks
        if num_swap is None:
            num_swap = swap_blocks_for(runner.spec, config.swap_space_gib)
        self.swap_space = SwapSpace(runner.spec, num_swap) if num_swap > 0 else None
        self.swapper = None
        # NOTE: a tensor-parallel engine whose ranks' KV pools it reaches (CPU) swaps every
        # rank's shard itself, so its `wait_for_writes` (steps and KV imports) covers them all;
        # otherwise (CUDA) each rank swaps its own, told by the step plan
        caches = runner.kv_caches if runner.ranks is not None else None
        self.rank_swap_spaces: list[SwapSpace] = []
        if self.swap_space is not None and caches is not None:
            self.rank_swap_spaces = [SwapSpace(runner.spec, num_swap) for _ in caches[1:]]
            hosts = [self.swap_space.tensor, *(space.tensor for space in self.rank_swap_spaces)]
            copy_fn = every_rank([c.tensor for c in caches], hosts, copy_fn)
        if self.swap_space is not None:
            self.swapper = Swapper(runner.kv_cache.tensor, self.swap_space.tensor, copy_fn=copy_fn)
        if self.kv.offload is not None:
            # NOTE: a promotion overwrites device blocks at once. Between steps every planned
            # swap-out is issued, so waiting for the swapper's pending reads is enough; inside
            # `schedule` a swap-out planned but not yet issued could still read them.
            self.kv.promote_on_match = False
            if self.swapper is not None:
                self.kv.offload.before_write = self.swapper.wait_for_writes
        self.scheduler = Scheduler(
            self._scheduler_config(),
            self.kv,
            self.swap_space.pool if self.swap_space else None,
            config.cost_model(),
            config.speculative,
        )
        self.errors: dict[RequestId, str] = {}  # request id -> why it finished with ERROR
        # Tests compare logits with the oracle's: when set, each sampled step's logits row.
        self.record_logits = False
        self.logits: dict[RequestId, list[torch.Tensor]] = {}
        self._ids = itertools.count()
        self._swap_seen = (0, 0.0)  # (bytes, busy seconds) already fed to the cost model

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str,
        config: DecodeEngineConfig | None = None,
        *,
        copy_fn: CopyFn | None = None,
        revision: str = "",
    ) -> DecodeEngine:
        config = config or DecodeEngineConfig()
        model_config = load_model_config(
            model_dir, config.dtype, config.quantization, config.kv_cache_dtype
        )
        return cls.from_model_config(model_config, config, copy_fn=copy_fn, revision=revision)

    @classmethod
    def from_model_config(
        cls,
        model_config: ModelConfig,
        config: DecodeEngineConfig,
        *,
        copy_fn: CopyFn | None = None,
        revision: str = "",
    ) -> DecodeEngine:
        """Load the weights (with more than one rank: start the rank processes, each loading
        its shard, model/tp_ranks.py) and build the engine over them."""
        if config.tensor_parallel_size > 1:
            runner, num_swap = cls._tensor_parallel_runner(model_config, config)
            config = replace(config, num_swap_blocks=num_swap)
        else:
            model = load_model(model_config, config.device)
            runner = ModelRunner(
                model_config, model, config.num_blocks, config.block_size, config.device
            )
        draft = _load_draft(model_config, config)
        return cls(model_config, runner, config, copy_fn=copy_fn, revision=revision, draft=draft)

    @staticmethod
    def _tensor_parallel_runner(
        model_config: ModelConfig, config: DecodeEngineConfig
    ) -> tuple[ModelRunner, int]:
        """Rank 0's runner and every rank's swap blocks, the other ranks started beside it
        (model/tp_ranks.py): each loads its shard of the weights and a KV cache and swap space
        of its KV heads, all at once."""
        size = config.tensor_parallel_size
        shard = tp_ranks.shard_model(model_config, 0, size)  # ValueError naming the flag
        num_swap = config.num_swap_blocks
        if num_swap is None:
            num_swap = swap_blocks_for(kv_cache_spec(shard, config.block_size),
                                       config.swap_space_gib)  # fmt: skip
        # NOTE: on CPU rank 0 swaps every rank's shard (DecodeEngine.__init__): none of its own
        rank_swap = 0 if config.device == "cpu" else num_swap
        spec = tp_ranks.RankSpec(
            model_config, config.num_blocks, config.block_size, rank_swap, config.device, size
        )
        return tp_ranks.start_runner(spec), num_swap

    def _scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            policy=self.config.scheduling_policy,
            preemption_mode=self.config.preemption_mode,
            min_priority_gap=self.config.min_priority_gap,
            max_preemptions=self.config.max_preemptions,
            bytes_per_block=self.runner.spec.bytes_per_block,
            eos_token_ids=self.model_config.eos_token_ids,
            kv_policy=self.config.kv_policy,
        )

    # -- requests ------------------------------------------------------------------------------

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """Speculative decoding's counts; None when it is off."""
        speculator = self.scheduler.speculator
        return speculator.stats if speculator is not None else None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
    ) -> Sequence:
        """Queue a request (lower `priority` runs sooner under the priority policy).

        InvalidArgument for a bad request; one that cannot fit this worker's KV cache even
        alone is returned finished with FinishReason.ERROR and its message in `errors`.
        """
        seq = self.new_sequence(
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
        )
        self.scheduler.add(seq)
        return seq

    def new_sequence(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
    ) -> Sequence:
        """A validated sequence with an empty table, not queued (InvalidArgument if bad).

        Touches no engine state but the pool reference of its empty table, so any thread may
        call it; queue it with `add_sequence` or `add_prefilled` on the engine's thread. A
        structured output's grammar is compiled here (cached), so a bad one is refused now.
        """
        self.runner.sampler.check(params)
        return make_sequence(
            self.model_config,
            self.max_model_len,
            self.pool,
            self.fingerprint,
            request_id or f"req-{next(self._ids)}",
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
        )

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from `new_sequence` (nothing computed, empty table)."""
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue a sequence whose table already holds its first `num_computed_tokens` tokens'
        KV (see `Scheduler.add_prefilled`); the engine owns and frees its blocks from here."""
        self.scheduler.add_prefilled(seq)

    def add_samples(
        self, parent: Sequence, samples: list[Sequence], *, prefilled: bool
    ) -> list[Sequence]:
        """Queue a multi-sample request forked by the caller (see `Scheduler.add_samples`);
        returns the members already finished."""
        return self.scheduler.add_samples(parent, samples, prefilled=prefilled)

    def add_beam_request(
        self, parent: Sequence, candidates: list[tuple[int, float]], *, prefilled: bool
    ) -> list[Sequence]:
        """Queue a beam search from its first candidates (see `Scheduler.add_beam_request`);
        returns the beams already finished."""
        return self.scheduler.add_beam_request(parent, candidates, prefilled=prefilled)

    def would_fit(self, num_prompt_tokens: int, max_tokens: int, num_samples: int = 1) -> bool:
        """Whether a request of this size can ever fit this worker's device pool alone."""
        worst = min(num_prompt_tokens + max_tokens, self.max_model_len)
        blocks = worst_case_blocks(num_prompt_tokens, worst, self.pool.block_size, num_samples)
        return blocks <= self.pool.num_blocks

    def abort(self, request_id: str) -> bool:
        """Free the request's device and host blocks now (every sample's); False if unknown
        or finished."""
        for seq in self.scheduler.members_of(request_id):
            self.runner.sampler.remove(seq.request_id)
        self.runner.sampler.remove(request_id)
        return self.scheduler.abort(request_id)

    def abort_one(self, request_id: str) -> bool:
        """Abort one sample of a multi-sample request by its own id (`sample_request_id`),
        sample 0 included; the other samples go on."""
        self.runner.sampler.remove(request_id)
        return self.scheduler.abort_one(request_id)

    def generate(
        self,
        prompts: Iterable[list[int]],
        params: SamplingParams | Iterable[SamplingParams],
        priorities: Iterable[int] | None = None,
    ) -> list[Sequence]:
        """Add every prompt, step until all finish, return the sequences in prompt order."""
        prompts = list(prompts)
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        all_priorities = [0] * len(prompts) if priorities is None else list(priorities)
        seqs = [
            self.add_request(p, sp, priority=pr)
            for p, sp, pr in zip(prompts, all_params, all_priorities, strict=True)
        ]
        while self.has_unfinished:
            self.step()
        return seqs

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> DecodeStepOutput:
        """Promote waiting prompts' host-tier blocks, schedule, move blocks, run one forward,
        apply its results."""
        self._promote_waiting()
        plan = self.scheduler.schedule()
        for failed in plan.failed:
            self.errors[failed.seq.request_id] = failed.message
        waited = self._prepare_blocks(plan)
        output = RunnerOutput(sampled=[])
        if self.draft is not None:
            drafted = fill_drafts(self.draft, plan.scheduled, [p.seq for p in plan.preempted])
        if plan.scheduled:
            start = time.perf_counter()
            output = self._execute(plan)
            self._observe_prefill(plan, time.perf_counter() - start)
            if self.draft is not None:
                settle_drafts(plan.scheduled, drafted, output)
        finished = self.scheduler.update(plan, output) + [f.seq for f in plan.failed]
        for seq in finished:
            self.runner.sampler.remove(seq.request_id)
        self._observe_swap()
        # NOTE: a KV import holds device blocks outside the scheduler until it hands its table
        # over (add_prefilled) or frees it; until then an empty plan is a wait, not a bug.
        if plan.is_empty and self.has_unfinished and not self.num_block_refs_outside:
            raise RuntimeError("decode engine: nothing schedulable (scheduler invariant broken)")
        return DecodeStepOutput(plan, finished, waited, self.pool.drain_events())

    def _promote_waiting(self) -> None:
        """Copy back from the host tier the prefixes of the waiting sequences this step could
        admit (best ranked first), so `schedule`'s prefix matches find them on the device."""
        if self.kv.offload is None:
            return
        seats = self.config.max_num_seqs - len(self.scheduler.running)
        for entry in heapq.nsmallest(max(seats, 0), self.scheduler.waiting):
            seq = entry.seq
            if not seq.wants_prompt_logprobs:
                self.kv.promote(seq.block_hashes, (seq.num_tokens - 1) // self.pool.block_size)

    def _execute(self, plan: DecodePlan) -> RunnerOutput:
        if not self.record_logits:
            return self.runner.execute(plan.scheduled)
        output, logits = self.runner.execute_with_logits(plan.scheduled)
        rows: Iterator[torch.Tensor] = iter(logits if logits is not None else [])
        for item, sampled in zip(plan.scheduled, output.sampled, strict=True):
            if sampled is not None:
                recorded = self.logits.setdefault(item.seq.request_id, [])
                recorded += [next(rows) for _ in range(1 + sampled.num_accepted)]
        return output

    @property
    def num_block_refs_outside(self) -> int:
        """Device-block references no queued sequence holds: tables KV imports are filling."""
        return self.pool.num_refs - self.scheduler.num_block_refs

    def _prepare_blocks(self, plan: DecodePlan) -> bool:
        """Issue the plan's swaps and copies, waiting only where an ordering rule needs it."""
        waited = False
        if self.swapper is not None:
            self.swapper.submit_plan(plan.swaps)
            if self.runner.ranks is not None and not self.rank_swap_spaces:
                swaps = [(s.direction is SwapDirection.IN, s.pairs) for s in plan.swaps]
                self.runner.note_swaps(swaps)
            waited = self.swapper.wait_for_writes(self._blocks_written(plan))
            self.swapper.wait_swap_in()
        elif plan.swaps:
            raise RuntimeError("decode engine: swap planned without a swap space")
        self.runner.copy_blocks(plan.copies)
        if self.draft is not None:
            self.draft.copy_blocks(list(plan.copies))
        return waited

    @staticmethod
    def _blocks_written(plan: DecodePlan) -> set[int]:
        """Device blocks this step writes: copy-on-write destinations and new tokens' slots."""
        blocks: set[int] = {dst for _, dst in plan.copies}
        for item in plan.scheduled:
            table, start = item.seq.block_table, item.seq.num_computed_tokens
            first, end = (
                start // table.block_size,
                -(-(start + item.num_query_tokens) // table.block_size),
            )
            blocks.update(table.block_ids[first:end])
        return blocks

    def _observe_prefill(self, plan: DecodePlan, seconds: float) -> None:
        # NOTE: a decode-heavy step says little about prefill speed; only prefill-heavy count.
        prefill = sum(item.num_new_tokens for item in plan.scheduled if item.num_new_tokens > 1)
        if 2 * prefill >= plan.num_batched_tokens:
            self.scheduler.cost_model.observe_prefill(plan.num_batched_tokens, seconds)

    def _observe_swap(self) -> None:
        if self.swapper is None:
            return
        stats = self.swapper.stats
        total = (stats.num_bytes_in + stats.num_bytes_out, stats.busy_seconds)
        seen_bytes, seen_seconds = self._swap_seen
        if total[1] > seen_seconds:
            self.scheduler.cost_model.observe_swap(total[0] - seen_bytes, total[1] - seen_seconds)
            self._swap_seen = total

    # -- lifecycle -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError unless the device pool, the host tier, the swap space and the
        queues agree."""
        self.scheduler.check_integrity()
        if self.kv.offload is not None:
            self.kv.offload.check_integrity(self.pool)
        if self.swap_space is not None:
            self.swap_space.check_integrity()

    def close(self) -> None:
        """Wait for in-flight swap copies, write the disk tier's queued blocks and release its
        directory, stop the ranks."""
        if self.swapper is not None:
            self.swapper.close()
        if self.kv.offload is not None:
            self.kv.offload.close()
        self.runner.close()


def _load_draft(target: ModelConfig, config: DecodeEngineConfig) -> DraftModel | None:
    """The draft model of `config.speculative`'s draft method (None for any other), in the
    target's dtype; ValueError naming `speculative-model` when its vocabulary differs."""
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return None
    draft_config = load_model_config(spec.draft_model, config.dtype)
    if draft_config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative-model: the draft's vocabulary ({draft_config.vocab_size} tokens) is "
            f"not the target's ({target.vocab_size}); a draft must share the target's tokenizer"
        )
    model = load_model(draft_config, config.device)
    return DraftModel(draft_config, model, config.num_blocks, config.block_size, config.device)
