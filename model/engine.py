"""`Engine`: an in-process generation loop over one `ModelRunner` and one block pool.

It is the smallest complete user of the runtime: FCFS admission under a token budget, chunked
prefill, prefix-cache reuse, continuous batching of decode steps. It has no preemption: when the
pool is short it stops admitting, and a running sequence that cannot grow is a `RuntimeError`
(the decode worker's scheduler, which preempts by swap or recompute, replaces this loop in a
served deployment). Tests use it to prove the runtime against transformers; benchmarks use it as
the "pagedserve without gRPC" peer.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedserve.errors import InvalidArgument
from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import model_fingerprint
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.config import ModelConfig, dtype_name, load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.progress import admit, advance
from pagedserve.model.runner import ModelRunner, ScheduledSequence
from pagedserve.model.sampler import make_generator
from pagedserve.model.sequence import RequestId, Sequence, SequenceStatus
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 512
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    dtype: str | None = None  # default: the checkpoint's
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


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
    )


def make_sequence(
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
        generator=make_generator(params.seed),
    )


@dataclass(slots=True)
class StepStats:
    num_scheduled_tokens: int = 0
    finished: list[Sequence] = field(default_factory=list)


class Engine:
    """Owns sequences from `add_request` until they finish; frees their blocks exactly once."""

    def __init__(self, model_config: ModelConfig, runner: ModelRunner, config: EngineConfig):
        self.model_config = model_config
        self.config = config
        self.runner = runner
        self.pool = BlockPool(config.num_blocks, config.block_size, record_events=False)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=config.enable_prefix_caching)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.fingerprint = model_fingerprint(model_config.raw, dtype=dtype_name(model_config.dtype))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.record_logits = False
        self.logits: dict[RequestId, list[torch.Tensor]] = {}
        self._ids = itertools.count()

    @classmethod
    def from_model_dir(cls, model_dir: str, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        model_config = load_model_config(model_dir, config.dtype)
        model = load_model(model_config, config.device)
        runner = ModelRunner(
            model_config, model, config.num_blocks, config.block_size, config.device
        )
        return cls(model_config, runner, config)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Sequence:
        """Queue a request. Raises InvalidArgument naming the field for a bad request."""
        seq = make_sequence(
            self.model_config,
            self.max_model_len,
            self.pool,
            self.fingerprint,
            request_id or f"req-{next(self._ids)}",
            prompt_token_ids,
            params,
            cache_salt=cache_salt,
        )
        worst_case = len(prompt_token_ids) + params.max_tokens
        if -(-worst_case // self.config.block_size) > self.config.num_blocks:
            raise InvalidArgument("max_tokens", f"{worst_case} tokens cannot fit in the KV cache")
        self.waiting.append(seq)
        return seq

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | Iterable[SamplingParams]
    ) -> list[Sequence]:
        """Add every prompt, step until all finish, return the sequences in prompt order."""
        prompts = list(prompts)
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, all_params, strict=True)]
        while self.has_unfinished:
            self.step()
        return seqs

    def step(self) -> StepStats:
        """Schedule, run one forward, apply its results."""
        batch = self._schedule()
        stats = StepStats(num_scheduled_tokens=sum(item.num_new_tokens for item in batch))
        if not batch:
            if self.has_unfinished:
                raise RuntimeError(
                    "engine: nothing schedulable (KV cache too small, no preemption)"
                )
            return stats
        output = self.runner.execute(batch, return_logits=self.record_logits)
        logit_rows = iter(output.logits) if output.logits is not None else None
        for item, sampled in zip(batch, output.sampled, strict=True):
            if sampled is not None and logit_rows is not None:
                self.logits.setdefault(item.seq.request_id, []).append(next(logit_rows))
            finished = advance(
                self.kv,
                item,
                sampled,
                eos_token_ids=self.model_config.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            if finished:
                self._release(item.seq)
                stats.finished.append(item.seq)
        return stats

    def abort(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.kv.free(seq.block_table)
                    seq.status = SequenceStatus.FINISHED
                    return True
        return False

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.block_table)

    def _schedule(self) -> list[ScheduledSequence]:
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        for seq in self.running:
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                break
            pairs = self.kv.allocate(seq.block_table, seq.num_computed_tokens + n)
            if pairs is None:
                raise RuntimeError(
                    f"{seq.request_id}: out of KV blocks and this engine cannot preempt"
                )
            copies += pairs
            batch.append(ScheduledSequence(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            admitted = admit(
                self.kv,
                self.waiting[0],
                budget,
                prefix_caching=self.config.enable_prefix_caching,
            )
            if admitted is None:
                break
            item, pairs = admitted
            copies += pairs
            self.waiting.popleft()
            self.running.append(item.seq)
            batch.append(item)
            budget -= item.num_new_tokens
        self.runner.copy_blocks(copies)
        return batch
