"""`PrefillEngine`: the prefill worker's model runner, block pool and scheduler; it only steps.

One `step()`::

    plan = schedule()              scheduler.schedule(): chunks under the token budget, allocated
    copy_blocks(plan)              copy-on-write pairs, before the forward that reads them
    output = execute(plan)         runner.execute(plan.scheduled): forward and sampling
    update(plan, output)           chunks count as computed, full blocks join the prefix cache,
                                   prompts whose first token was sampled are handed back

No thread, no lock: `PrefillWorker` (worker.py) drives these phases from its loop thread and
holds its lock around `schedule` and `update` but not around `copy_blocks` and `execute`, which
touch only the KV slots of the plan's chunks (never a block with a hash) and the sampler.

A failed `execute` changes no bookkeeping: chunks count as computed, and full blocks join the
prefix cache, only in `update()`, so a half-written chunk is rewritten whole and never reachable
by a prefix hit; the worker may re-run the plan's chunks alone (failure isolation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.errors import InvalidArgument
from pagedserve.kvstore.block_pool import BlockEvent, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.eviction import DEFAULT_EVICTION_POLICY, EvictionPolicy
from pagedserve.kvstore.hashing import BlockHash, hash_blocks
from pagedserve.kvstore.kv_offload import check_offload_config, kv_cache_manager
from pagedserve.kvstore.transfer import ShmKVPool, ShmOffer, layout_compat_hash
from pagedserve.model.config import ModelConfig, load_model_config, model_len
from pagedserve.model.loader import load_model
from pagedserve.model.quant import WeightQuant
from pagedserve.model.requests.batch import RunnerOutput, StepPlan
from pagedserve.model.requests.sequence import Sequence, make_sequence, sample_request_ids
from pagedserve.model.runner import ModelRunner, kv_cache_spec
from pagedserve.model.tp_ranks import RankSpec, shard_model, start_runner
from pagedserve.prefill_worker.scheduler import PrefillScheduler, PrefillSchedulerConfig
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillEngineConfig:
    """The pool, batch limits, model and device of one engine (the fields the decode engine's
    config shares: engine_sizing.EngineFields), its leases and admission limit."""

    block_size: int = 16
    num_blocks: int = 1024
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
    lease_seconds: float = 30.0  # the worker's lease defaults
    max_lease_seconds: float = 300.0
    use_shm: bool = True  # allocate the pool in shared memory (offer the shm transport)
    # NOTE: one router's --max-queued-requests default: a burst that router admits fits
    max_queued_requests: int = 4096  # the worker's admission limit

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        check_offload_config(
            self.kv_offload_blocks,
            self.tensor_parallel_size,
            self.kv_offload_dir,
            self.kv_offload_disk_bytes,
        )


@dataclass(slots=True)
class PrefillStepOutput:
    """What one step did. `done` prompts (batch order) have their first token appended and may
    already be FINISHED; their blocks are the caller's to lease or free."""

    plan: StepPlan
    done: list[Sequence] = field(default_factory=list)
    events: list[BlockEvent] = field(default_factory=list)  # the pool's, for the prefix index


class PrefillEngine:
    """Owns the prefill worker's model runner, block pool and scheduler. Not thread-safe."""

    def __init__(
        self,
        model_config: ModelConfig,
        runner: ModelRunner,
        config: PrefillEngineConfig,
        *,
        shm_pool: ShmKVPool | None = None,
        revision: str = "",
    ) -> None:
        """`runner` (rank 0's, model/tp_ranks.py, with more than one rank) owns the KV
        cache; `shm_pool`: the shared-memory segment that cache lies in (the engine closes it)."""
        self.model_config = model_config
        self.config = config
        self.runner = runner
        self.shm_pool = shm_pool
        self.max_model_len = model_len(model_config, config.max_model_len)
        # NOTE: computed exactly as the decode worker does, so block hashes and the layout
        # compat hash agree across the two (docs/hashing.md).
        self.fingerprint = model_config.fingerprint(revision)
        self.compat_hash = layout_compat_hash(
            runner.spec, self.fingerprint, config.tensor_parallel_size
        )
        self.pool = BlockPool(
            config.num_blocks, config.block_size, eviction_policy=config.eviction_policy
        )
        self.kv = kv_cache_manager(
            self.pool, runner.spec, runner.kv_cache.tensor, config, self.fingerprint
        )
        self.scheduler = PrefillScheduler(
            self.kv,
            PrefillSchedulerConfig(
                config.max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching
            ),
            eos_token_ids=model_config.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_cached = 0

    @classmethod
    def from_model_dir(
        cls, model_dir: str, config: PrefillEngineConfig, *, revision: str = ""
    ) -> PrefillEngine:
        model_config = load_model_config(
            model_dir, config.dtype, config.quantization, config.kv_cache_dtype
        )
        return cls.from_model_config(model_config, config, revision=revision)

    @classmethod
    def from_model_config(
        cls, model_config: ModelConfig, config: PrefillEngineConfig, *, revision: str = ""
    ) -> PrefillEngine:
        """Load the weights (with more than one rank: start the rank processes, each loading
        its shard, model/tp_ranks.py) and build the engine over them."""
        size, device = config.tensor_parallel_size, config.device
        rank_config = shard_model(model_config, 0, size) if size > 1 else model_config
        spec = kv_cache_spec(rank_config, config.block_size)
        # NOTE: shared memory is host memory; on CUDA the pool stays on the device (cuda_ipc later)
        shm_pool = ShmKVPool(spec, config.num_blocks) if config.use_shm else None
        own_cache = shm_pool.cache if shm_pool else None
        if size == 1:
            model = load_model(model_config, device)
            runner = ModelRunner(rank_config, model, config.num_blocks, config.block_size,
                                 device, kv_cache=own_cache)  # fmt: skip
        else:
            ranks = RankSpec(model_config, config.num_blocks, config.block_size, 0, device, size)
            runner = start_runner(ranks, kv_cache=own_cache)
        return cls(model_config, runner, config, shm_pool=shm_pool, revision=revision)

    # ---- requests -------------------------------------------------------------------------

    def new_sequence(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        priority: int = 0,
        cache_salt: str = "",
    ) -> Sequence:
        """A validated sequence with an empty table, not queued (InvalidArgument if bad or if
        the prompt can never fit this pool). Touches no engine state: any thread may call it.
        A structured output's grammar is compiled here (cached), so a bad one is refused now."""
        self.runner.sampler.check(params)
        seq = make_sequence(
            self.model_config,
            self.max_model_len,
            self.pool,
            self.fingerprint,
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
        )
        if -(-len(prompt_token_ids) // self.config.block_size) > self.config.num_blocks:
            raise InvalidArgument("prompt_token_ids", "prompt does not fit in the KV cache")
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from `new_sequence` (ValueError if its id is already queued)."""
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running prompt and free its blocks now; False if unknown here."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            self.runner.sampler.remove(request_id)
            return False
        self._forget_generators(seq)
        return True

    def _forget_generators(self, seq: Sequence) -> None:
        """Drop the generators of every sample of `seq` (its first tokens are all drawn here)."""
        for request_id in sample_request_ids(seq.request_id, seq.params.num_samples):
            self.runner.sampler.remove(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def free(self, table: BlockTable) -> None:
        """Free a handed-over prompt's blocks (its lease ended); full ones stay cached."""
        self.kv.free(table)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> PrefillStepOutput:
        """Schedule, run one forward, apply its results. A forward that raises escapes with
        no bookkeeping changed (the plan's chunks stay allocated and uncomputed)."""
        plan = self.schedule()
        if not plan.scheduled:
            return PrefillStepOutput(plan)
        self.copy_blocks(plan)
        return self.update(plan, self.execute(plan))

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()

    def copy_blocks(self, plan: StepPlan) -> None:
        self.runner.copy_blocks(plan.copies)

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """The forward and sampling of the plan's chunks: tensors only, no bookkeeping."""
        return self.runner.execute(plan.scheduled)

    def update(self, plan: StepPlan, output: RunnerOutput) -> PrefillStepOutput:
        """Apply a forward's results (`plan` may be any part of a scheduled plan, each chunk
        applied at most once). Prompts aborted since `schedule` are skipped."""
        done = self.scheduler.update(plan, output)
        for item, sampled in zip(plan.scheduled, output.sampled, strict=True):
            if sampled is not None and sampled.forks:
                item.seq.fork_first_tokens = [(t.token_id, t.logprobs) for t in sampled.forks]
            if sampled is not None and sampled.candidates:
                item.seq.beam_candidates = sampled.candidates
            if sampled is not None or not self.scheduler.is_in_flight(item.seq):
                self._forget_generators(item.seq)  # done or aborted
        self.num_prompt_tokens_computed += plan.num_batched_tokens
        self.num_prompt_tokens_cached += sum(seq.num_cached_prompt_tokens for seq in done)
        return PrefillStepOutput(plan, done, self.pool.drain_events())

    # ---- state ----------------------------------------------------------------------------

    def shm_offers(self) -> list[ShmOffer]:
        """Where every tensor-parallel rank's pool lies in shared memory, rank order (one
        entry for one rank); empty when the pools are not all there (no shm, or CUDA)."""
        if self.shm_pool is None:
            return []
        others = self.runner.ranks.pools if self.runner.ranks is not None else []
        if len(others) != self.config.tensor_parallel_size - 1:
            return []
        return [self.shm_pool.offer(), *(pool.offer() for pool in others)]

    def check_integrity(self) -> None:
        """Raise RuntimeError unless the pool's counts (and the host tier's) agree."""
        self.kv.check_integrity()

    def count_cached(self, prompts: list[list[int]], cache_salt: str) -> int:
        """How many distinct full blocks of `prompts` the prefix cache holds now."""
        hashes: set[BlockHash] = set()
        for prompt in prompts:
            hashes.update(
                hash_blocks(
                    prompt,
                    self.config.block_size,
                    model_fingerprint=self.fingerprint,
                    cache_salt=cache_salt,
                )
            )
        return sum(1 for h in hashes if self.pool.lookup(h) is not None)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and release the shared-memory segments
        (nothing may read them afterwards); write the disk tier's queued blocks and release its
        directory."""
        if self.kv.offload is not None:
            self.kv.offload.close()
        self.runner.close()
        if self.shm_pool is not None:
            self.runner.kv_cache = None  # type: ignore[assignment]
            self.shm_pool.close()
            self.shm_pool = None
