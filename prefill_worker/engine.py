"""`PrefillEngine`: prompts in, first tokens and leased KV blocks out (DESIGN §3.5).

Lifecycle of a prompt's blocks on this side:

    ALLOCATED/FILLING (scheduler) ──► first token sampled ──► LEASED (LeaseTable)
        ──► ReleaseKv or expiry ──► RELEASED: full blocks stay in the prefix cache (LRU)

Threads: one loop thread runs `step()`; gRPC threads call `submit`, `abort`, `release`, `renew`
and read leased blocks. One lock guards the scheduler, the pool and the lease table's frees; the
forward itself runs without it. It only writes the slots of the chunks the scheduler allocated to
the batch (never a block with a hash). An `abort` during the forward frees its prompt's blocks at
once; only the loop thread allocates, so nothing reuses them before the forward ends, and
`PrefillScheduler.update` skips the aborted prompt.

Failures. A forward that raises is isolated (`_isolate_failure`): each prompt of the failed step
is run alone, and only those that fail alone end, with `PrefillFailed` naming the request; the
others keep the results of their run alone. This is exact because a failed forward changes no
bookkeeping: chunks count as computed, and full blocks join the prefix cache, only in
`update()` after a forward succeeds, so a half-written chunk is rewritten whole and never
reachable by a prefix hit. If the loop thread itself dies, `dead` is set, `on_loop_death` runs
(the server flips health to NOT_SERVING) and every prompt in flight fails with `Unavailable`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pagedserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pagedserve.kvstore.block_pool import BlockEvent, BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash, hash_blocks, model_fingerprint
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.kvstore.transfer import ShmKVPool, layout_compat_hash
from pagedserve.model.config import ModelConfig, dtype_name, load_model_config
from pagedserve.model.engine import make_sequence
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.loader import load_model
from pagedserve.model.runner import ModelRunner, RunnerOutput, ScheduledSequence, kv_cache_spec
from pagedserve.model.sequence import Sequence
from pagedserve.prefill_worker.lease_table import Lease, LeaseReaper, LeaseState, LeaseTable
from pagedserve.prefill_worker.scheduler import (
    PrefillPlan,
    PrefillScheduler,
    PrefillSchedulerConfig,
)
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillEngineConfig:
    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    lease_seconds: float = 30.0
    max_lease_seconds: float = 300.0
    use_shm: bool = True  # allocate the pool in shared memory (offer the shm transport)
    max_queued_requests: int = 1024


@dataclass(slots=True)
class PrefillResult:
    """A finished prefill. `lease` is None when the first token already ended the request."""

    seq: Sequence
    lease: Lease[BlockTable] | None
    lease_expires_unix_ms: int = 0
    # wall-clock ns, for the prefill.queue / prefill.compute spans
    enqueued_ns: int = 0
    started_ns: int = 0
    finished_ns: int = 0


class PrefillFailed(RuntimeError):
    """This prompt's step failed even when run alone: a fault of this request (or of the engine),
    never the caller's mistake. The message starts with the request id."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"{request_id}: {reason}")
        self.request_id = request_id


@dataclass(slots=True)
class _Pending:
    seq: Sequence
    future: Future[PrefillResult]
    lease_s: float
    enqueued_at: float = field(default_factory=time.monotonic)
    enqueued_ns: int = field(default_factory=time.time_ns)
    started_ns: int = 0


class PrefillEngine:
    """Owns the prefill worker's model runner, block pool, scheduler and leases."""

    def __init__(
        self,
        model_config: ModelConfig,
        model: LlamaForCausalLM,
        config: PrefillEngineConfig,
        *,
        device: str = "cpu",
        revision: str = "",
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.fingerprint = model_fingerprint(
            model_config.raw, dtype=dtype_name(model_config.dtype), revision=revision
        )
        spec = kv_cache_spec(model_config, config.block_size)
        # NOTE: shared memory is host memory; on CUDA the pool stays on the device (cuda_ipc later)
        self.shm_pool = ShmKVPool(spec, config.num_blocks) if config.use_shm else None
        self.runner = ModelRunner(
            model_config,
            model,
            config.num_blocks,
            config.block_size,
            device,
            kv_cache=self.shm_pool.cache if self.shm_pool else None,
        )
        self.compat_hash = layout_compat_hash(spec, self.fingerprint)
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = PrefillScheduler(
            self.kv,
            PrefillSchedulerConfig(
                config.max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching
            ),
            eos_token_ids=model_config.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        self.leases: LeaseTable[BlockTable] = LeaseTable(self._free_leased)
        self.reaper = LeaseReaper(self.leases)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[str, _Pending] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dead = False  # the loop thread died: this engine can prefill nothing more
        self.on_loop_death: Callable[[], None] | None = None
        self.on_events: Callable[[list[BlockEvent]], None] | None = None
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_cached = 0

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str,
        config: PrefillEngineConfig,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        revision: str = "",
    ) -> PrefillEngine:
        model_config = load_model_config(model_dir, dtype)
        model = load_model(model_config, device)
        return cls(model_config, model, config, device=device, revision=revision)

    # ---- requests -------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
        lease_seconds: float = 0.0,
    ) -> Future[PrefillResult]:
        """Queue a prompt; the future resolves after its first token (or fails with the reason).

        Raises InvalidArgument for a bad request, ResourceExhausted when the queue is full and
        Unavailable once the loop has died. The future fails with PrefillFailed if the prompt's
        step fails even alone, with Unavailable if the loop dies first.
        """
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
        blocks_needed = -(-len(prompt_token_ids) // self.config.block_size)
        if blocks_needed > self.config.num_blocks:
            raise InvalidArgument("prompt_token_ids", "prompt does not fit in the KV cache")
        lease_s = min(lease_seconds or self.config.lease_seconds, self.config.max_lease_seconds)
        future: Future[PrefillResult] = Future()
        with self._wake:
            if self.dead:
                raise Unavailable("prefill engine stopped")
            if len(self._pending) >= self.config.max_queued_requests:
                raise ResourceExhausted("prefill queue is full", retry_after_s=1.0)
            if request_id in self._pending:
                raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
            self.scheduler.add(seq)
            self._pending[request_id] = _Pending(seq, future, lease_s)
            self._wake.notify()
        return future

    def abort(self, request_id: str) -> bool:
        """Drop a queued or running prompt and free its blocks, or, once its prefill is done,
        end the lease granted to it (its caller gave up and may never see the handle). False
        if neither is here.

        NOTE: a prompt leaves `_pending` and its lease is granted under one lock hold
        (`_hand_over`), so an abort finds one or the other, never the gap between them.
        """
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return self.leases.release_request(request_id) > 0
            self.scheduler.abort(request_id)
        pending.future.cancel()
        return True

    def warmup(
        self, prompts: list[list[int]], *, cache_salt: str = "", timeout_s: float | None = None
    ) -> int:
        """Prefill `prompts` into the prefix cache (no lease is taken); wait for all of them.

        Returns how many distinct full blocks of the prompts the prefix cache holds afterwards.
        Raises like `submit` for a bad prompt (nothing of a refused batch is queued after it),
        TimeoutError if `timeout_s` passes first.
        """
        params = SamplingParams(temperature=0.0, max_tokens=1)
        futures = [
            self.submit(f"warmup-{secrets.token_hex(8)}", p, params, cache_salt=cache_salt)
            for p in prompts
        ]
        for future in futures:
            future.result(timeout=timeout_s)
        return self._count_cached(prompts, cache_salt)

    def _count_cached(self, prompts: list[list[int]], cache_salt: str) -> int:
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
        with self._lock:
            return sum(1 for h in hashes if self.pool.lookup(h) is not None)

    # ---- leases ---------------------------------------------------------------------------

    def release(self, handle_id: str) -> bool:
        return self.leases.release(handle_id)

    def renew(self, handle_id: str, extend_s: float) -> int | None:
        """New expiry in Unix ms, or None if the lease is gone."""
        extend_s = min(extend_s or self.config.lease_seconds, self.config.max_lease_seconds)
        expires = self.leases.renew(handle_id, extend_s)
        return None if expires is None else _unix_ms(expires, self.leases.clock())

    def leased_blocks(self, handle_id: str) -> list[int] | None:
        """Block ids pinned by an active lease, or None (see `lease_state` for why)."""
        lease = self.leases.get(handle_id)
        return None if lease is None else list(lease.resource.block_ids)

    def lease_state(self, handle_id: str) -> LeaseState:
        """ACTIVE, EXPIRED (recently), or UNKNOWN (never granted, released, or long expired)."""
        return self.leases.state(handle_id)

    def check_integrity(self) -> None:
        """`BlockPool.check_integrity()` under the engine's lock (safe while serving)."""
        with self._lock:
            self.pool.check_integrity()

    def registered_hashes(self) -> list:
        """Hashes of every block a prefix hit could use now (for republishing the index)."""
        with self._lock:
            return self.pool.registered_hashes()

    def _free_leased(self, lease: Lease[BlockTable]) -> None:
        with self._wake:
            self.kv.free(lease.resource)
            self._wake.notify()

    # ---- loop -----------------------------------------------------------------------------

    def start(self) -> None:
        self.reaper.start()
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.reaper.stop()

    def close(self) -> None:
        """Stop, then release the shared-memory segment (nothing may read it afterwards)."""
        self.stop()
        if self.shm_pool is not None:
            self.runner.kv_cache = None  # type: ignore[assignment]
            self.shm_pool.close()
            self.shm_pool = None

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self.scheduler.has_work():
                        self._wake.wait(0.5)
                    if self._stop:
                        return
                try:
                    self.step()
                except Exception:
                    # NOTE: not a forward (those are isolated in `step`): bookkeeping may be
                    # half done, so no prompt in flight can be trusted
                    log.exception("prefill step failed outside the forward; failing all")
                    self._fail_all_in_flight(lambda rid: PrefillFailed(rid, "prefill step failed"))
        except BaseException:
            log.exception("prefill loop died; failing every prompt in flight")
            self._die()

    def _die(self) -> None:
        with self._lock:
            self.dead = True  # NOTE: first, so that no submit slips in after the failing below
        if self.on_loop_death is not None:
            self.on_loop_death()
        self._fail_all_in_flight(lambda rid: Unavailable(f"{rid}: prefill engine stopped"))

    def step(self) -> int:
        """Run one prefill step; returns the number of prompt tokens computed.

        A forward that raises does not escape: the step's prompts run alone and those that fail
        alone fail (`_isolate_failure`). Anything else that raises is a bug and escapes.
        """
        plan = self._schedule()
        if plan is None:
            return 0
        self.runner.copy_blocks(plan.copies)
        generators = _generator_states(plan.batch)
        try:
            output = self.runner.execute(plan.batch)
        except Exception:
            log.exception("prefill step of %d prompts failed; running each alone", len(plan.batch))
            return self._isolate_failure(plan, generators)
        self._apply(plan, output)
        return plan.num_tokens

    def _schedule(self) -> PrefillPlan | None:
        with self._lock:
            plan = self.scheduler.schedule()
            if not plan.batch:
                self._wake.wait(0.05)  # NOTE: pool full of leased blocks; wait for frees
                return None
            now_ns = time.time_ns()
            for item in plan.batch:
                pending = self._pending.get(item.seq.request_id)
                if pending is not None and not pending.started_ns:
                    pending.started_ns = now_ns
            return plan

    def _apply(self, plan: PrefillPlan, output: RunnerOutput) -> None:
        """Advance the plan's prompts, hand over those done, publish the pool's events."""
        with self._lock:
            done = self.scheduler.update(plan, output)
            self.num_prompt_tokens_computed += plan.num_tokens
            events = self.pool.drain_events()
            finished = [self._hand_over(seq) for seq in done]
        for pending, result in finished:
            if pending is not None:
                pending.future.set_result(result)
        if events and self.on_events is not None:
            self.on_events(events)

    def _isolate_failure(self, plan: PrefillPlan, generators: dict[int, torch.Tensor]) -> int:
        """Run each chunk of a failed step alone: keep the results of those that succeed, fail
        the prompts whose chunk raises alone. Returns the prompt tokens computed.

        NOTE: the failed forward advanced nothing and registered no hash; its chunks' slots are
        still allocated, so a run alone rewrites exactly those slots. Seeded generators are
        reset to their state before the failed step, so a run alone samples what a clean step
        would have.
        """
        computed, culprits = 0, []
        for item in plan.batch:
            with self._lock:
                if not self.scheduler.is_in_flight(item.seq):
                    continue  # aborted meanwhile: its blocks are already free
            state = generators.get(id(item.seq))
            if state is not None and item.seq.generator is not None:
                item.seq.generator.set_state(state)
            try:
                output = self.runner.execute([item])
            except Exception:
                log.exception("%s: prefill failed alone after a failed step", item.seq.request_id)
                culprits.append(item.seq)
                continue
            self._apply(PrefillPlan([item], []), output)
            computed += item.num_new_tokens
        if not culprits:
            log.warning("prefill step failed, but each of its prompts succeeded alone")
        self._fail(culprits, "prefill step failed")
        return computed

    def _fail(self, seqs: list[Sequence], reason: str) -> None:
        """End each of `seqs` still in flight with PrefillFailed; its blocks are freed now."""
        failed = []
        with self._wake:
            for seq in seqs:
                if not self.scheduler.is_in_flight(seq):
                    continue
                self.scheduler.abort(seq.request_id)
                pending = self._pending.pop(seq.request_id, None)
                if pending is not None:
                    failed.append(pending)
            self._wake.notify()
        for pending in failed:
            pending.future.set_exception(PrefillFailed(pending.seq.request_id, reason))

    def _hand_over(self, seq: Sequence) -> tuple[_Pending | None, PrefillResult]:
        pending = self._pending.pop(seq.request_id, None)
        self.num_prompt_tokens_cached += seq.num_cached_prompt_tokens
        result = PrefillResult(seq, None, finished_ns=time.time_ns())
        if pending is not None:
            result.enqueued_ns, result.started_ns = pending.enqueued_ns, pending.started_ns
        if seq.is_finished or pending is None:
            self.kv.free(seq.block_table)
            return pending, result
        result.lease = self.leases.grant(seq.request_id, seq.block_table, pending.lease_s)
        result.lease_expires_unix_ms = _unix_ms(result.lease.expires_at, self.leases.clock())
        return pending, result

    def _fail_all_in_flight(self, error: Callable[[str], Exception]) -> None:
        """Fail every queued or running prompt with `error(request_id)`; free their blocks."""
        with self._wake:
            pending = list(self._pending.values())
            for p in pending:
                self.scheduler.abort(p.seq.request_id)
            self._pending.clear()
            self._wake.notify()
        for p in pending:
            p.future.set_exception(error(p.seq.request_id))


def _generator_states(batch: list[ScheduledSequence]) -> dict[int, torch.Tensor]:
    """The state of each seeded sequence's generator, by `id(seq)`, to undo a failed step."""
    return {id(i.seq): i.seq.generator.get_state() for i in batch if i.seq.generator is not None}


def _unix_ms(monotonic_deadline: float, monotonic_now: float) -> int:
    return int((time.time() + (monotonic_deadline - monotonic_now)) * 1000)
