"""`PrefillWorker`: the prefill worker's threads, leases and failure isolation around one
`PrefillEngine` (docs/leases.md).

Lifecycle of a prompt's blocks on this side:

    ALLOCATED/FILLING (scheduler) ──► first token sampled ──► LEASED (LeaseTable)
        ──► ReleaseKv or expiry ──► RELEASED: full blocks stay in the prefix cache (LRU)

Threads: one loop thread runs `step()`; gRPC threads call `submit`, `abort`, `release`, `renew`
and read leased blocks. `lock` guards the engine's scheduler and pool and the lease table's
frees; the forward itself runs without it (`PrefillEngine.execute`). It only writes the slots of
the chunks the scheduler allocated to the batch. An `abort` during the forward frees its
prompt's blocks at once; only the loop thread allocates, so nothing reuses them before the
forward ends, and `PrefillEngine.update` skips the aborted prompt.

Failures. A forward that raises is isolated (`_isolate_failure`): each prompt of the failed step
is run alone, and only those that fail alone end, with `PrefillFailed` naming the request; the
others keep the results of their run alone. This is exact because a failed forward changes no
bookkeeping (see engine.py), and the sampler's generators are restored to their state before
the failed step. If the loop thread itself dies, `dead` is set, `on_loop_death` runs (the server
flips health to NOT_SERVING) and every prompt in flight fails with `Unavailable`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pagedserve.grpcutil import EngineLoop
from pagedserve.kvstore.block_pool import BlockEvent, Tier
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.model.requests.batch import RunnerOutput, StepPlan
from pagedserve.model.requests.sequence import RequestId, Sequence, sample_request_ids
from pagedserve.model.sampler import GeneratorStates
from pagedserve.model.tp_pipes import RankLost
from pagedserve.prefill_worker.engine import PrefillEngine
from pagedserve.prefill_worker.lease_table import Lease, LeaseReaper, LeaseState, LeaseTable
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker_hooks import NO_HOOKS, WorkerHooks

log = logging.getLogger(__name__)


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


class PrefillWorker:
    """Owns the prompts in flight, the leases of finished ones and the loop thread."""

    def __init__(
        self,
        engine: PrefillEngine,
        hooks: WorkerHooks = NO_HOOKS,
        *,
        on_events: Callable[[list[BlockEvent]], None] | None = None,
    ) -> None:
        """`on_events`: gets each step's block events (the prefix index's publisher); called
        on the loop thread without the lock, it must not block."""
        self.engine = engine
        self.config = engine.config
        self.leases: LeaseTable[BlockTable] = LeaseTable(self._free_leased)
        self.reaper = LeaseReaper(self.leases)
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._pending: dict[str, _Pending] = {}
        self._stop = False
        # NOTE: a server runs the loop on the main thread (WorkerHooks.engine_loop)
        self.engine_loop = hooks.engine_loop or EngineLoop("prefill-loop")
        self.core_share = hooks.core_share
        self.on_loop_death = hooks.on_loop_death
        self.on_events = on_events
        self.dead = False  # the loop thread died: this worker can prefill nothing more
        self.death: BaseException | None = None  # what killed the loop

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
        seq = self.engine.new_sequence(
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
        )
        lease_s = min(lease_seconds or self.config.lease_seconds, self.config.max_lease_seconds)
        future: Future[PrefillResult] = Future()
        with self._wake:
            if self.dead:
                raise Unavailable("prefill engine stopped")
            if len(self._pending) >= self.config.max_queued_requests:
                raise ResourceExhausted("prefill queue is full", retry_after_s=1.0)
            if request_id in self._pending:
                raise InvalidArgument("request_id", f"{request_id!r} is already in flight")
            self.engine.add_sequence(seq)
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
        with self.lock:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return self.leases.release_request(request_id) > 0
            self.engine.abort(request_id)
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
        with self.lock:
            return self.engine.count_cached(prompts, cache_salt)

    @property
    def num_in_flight(self) -> int:
        with self.lock:
            return len(self._pending)

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
        """`BlockPool.check_integrity()` under the worker's lock (safe while serving)."""
        with self.lock:
            self.engine.check_integrity()

    def registered_hashes(self) -> dict[BlockHash, Tier]:
        """Hashes of every block a prefix hit could use now, with the tier holding each (the
        device pool, the host or disk tier), for republishing the index."""
        with self.lock:
            return self.engine.kv.held_hashes()

    def _free_leased(self, lease: Lease[BlockTable]) -> None:
        with self._wake:
            self.engine.free(lease.resource)
            self._wake.notify()

    # ---- loop -----------------------------------------------------------------------------

    def start(self) -> None:
        self.reaper.start()
        self.engine_loop.start(self._run)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and the lease reaper; prompts in flight stay unanswered."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self.engine_loop.join(timeout_s)
        self.reaper.stop()

    def close(self) -> None:
        """Stop, then close the engine (its shared-memory segment goes)."""
        self.stop()
        self.engine.close()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    if not self.engine.has_unfinished and self.core_share is not None:
                        self.core_share.idle()
                    while not self._stop and not self.engine.has_unfinished:
                        self._wake.wait(0.5)
                        self.engine.runner.check_ranks()  # NOTE: a dead rank kills the loop
                    if self._stop:
                        return
                    if self.core_share is not None:
                        self.core_share.busy()
                try:
                    self.step()
                except RankLost:
                    raise  # NOTE: not the prompts' fault: the loop dies, health NOT_SERVING
                except Exception:
                    # NOTE: not a forward (those are isolated in `step`): bookkeeping may be
                    # half done, so no prompt in flight can be trusted
                    log.exception("prefill step failed outside the forward; failing all")
                    self._fail_all(lambda rid: PrefillFailed(rid, "prefill step failed"))
        except BaseException as exc:
            log.exception("prefill loop died; failing every prompt in flight")
            self.death = exc
            self._die(exc)

    def _die(self, death: BaseException) -> None:
        with self.lock:
            self.dead = True  # NOTE: first, so that no submit slips in after the failing below
        if self.on_loop_death is not None:
            self.on_loop_death(death)
        self._fail_all(lambda rid: Unavailable(f"{rid}: prefill engine stopped"))

    def step(self) -> int:
        """One engine step and its hand-overs (the loop's body; tests may call it directly).

        Returns the number of prompt tokens computed. A forward that raises does not escape:
        the step's prompts run alone and those that fail alone fail (`_isolate_failure`).
        Anything else that raises is a bug and escapes.
        """
        plan = self._schedule()
        if plan is None:
            return 0
        self.engine.copy_blocks(plan)  # NOTE: outside the isolation: a failed copy fails all
        generators = self.engine.runner.sampler.save(
            sid for i in plan.scheduled for sid in _sample_ids(i.seq)
        )
        try:
            output = self.engine.execute(plan)
        except RankLost:
            raise
        except Exception:
            log.exception(
                "prefill step of %d prompts failed; running each alone", len(plan.scheduled)
            )
            return self._isolate_failure(plan, generators)
        self._apply(plan, output)
        return plan.num_batched_tokens

    def _schedule(self) -> StepPlan | None:
        with self.lock:
            plan = self.engine.schedule()
            if not plan.scheduled:
                self._wake.wait(0.05)  # NOTE: pool full of leased blocks; wait for frees
                return None
            now_ns = time.time_ns()
            for item in plan.scheduled:
                pending = self._pending.get(item.seq.request_id)
                if pending is not None and not pending.started_ns:
                    pending.started_ns = now_ns
            return plan

    def _apply(self, plan: StepPlan, output: RunnerOutput) -> None:
        """Advance the plan's prompts, hand over those done, publish the pool's events."""
        with self.lock:
            out = self.engine.update(plan, output)
            finished = [self._hand_over(seq) for seq in out.done]
        for pending, result in finished:
            if pending is not None:
                pending.future.set_result(result)
        if out.events and self.on_events is not None:
            self.on_events(out.events)

    def _isolate_failure(self, plan: StepPlan, generators: GeneratorStates) -> int:
        """Run each chunk of a failed step alone: keep the results of those that succeed, fail
        the prompts whose chunk raises alone. Returns the prompt tokens computed.

        NOTE: the failed forward advanced nothing and registered no hash; its chunks' slots are
        still allocated, so a run alone rewrites exactly those slots. Seeded generators are
        reset to their state before the failed step, so a run alone samples what a clean step
        would have.
        """
        computed, culprits = 0, []
        for item in plan.scheduled:
            with self.lock:
                if not self.engine.scheduler.is_in_flight(item.seq):
                    continue  # aborted meanwhile: its blocks are already free
            rid = item.seq.request_id
            self.engine.runner.sampler.restore(
                {sid: generators[sid] for sid in _sample_ids(item.seq)}
            )
            alone = StepPlan([item])
            try:
                output = self.engine.execute(alone)
            except Exception:
                log.exception(
                    "%s: prefill failed alone after a failed step", rid, extra={"request_id": rid}
                )
                culprits.append(item.seq)
                continue
            self._apply(alone, output)
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
                if not self.engine.scheduler.is_in_flight(seq):
                    continue
                self.engine.abort(seq.request_id)
                pending = self._pending.pop(seq.request_id, None)
                if pending is not None:
                    failed.append(pending)
            self._wake.notify()
        for pending in failed:
            pending.future.set_exception(PrefillFailed(pending.seq.request_id, reason))

    def _hand_over(self, seq: Sequence) -> tuple[_Pending | None, PrefillResult]:
        pending = self._pending.pop(seq.request_id, None)
        result = PrefillResult(seq, None, finished_ns=time.time_ns())
        if pending is not None:
            result.enqueued_ns, result.started_ns = pending.enqueued_ns, pending.started_ns
        if not self._goes_on(seq) or pending is None:
            self.engine.free(seq.block_table)
            return pending, result
        result.lease = self.leases.grant(seq.request_id, seq.block_table, pending.lease_s)
        result.lease_expires_unix_ms = _unix_ms(result.lease.expires_at, self.leases.clock())
        return pending, result

    def _goes_on(self, seq: Sequence) -> bool:
        """Whether any sample of `seq` goes on after its first token (the KV is handed over)."""
        if not seq.is_finished or seq.params.use_beam_search:
            return True  # NOTE: a beam search's first step is the decode worker's
        engine = self.engine
        eos = engine.model_config.eos_token_ids
        return any(
            seq.first_token_finish(token, engine.max_model_len, eos) is None
            for token, _ in seq.fork_first_tokens
        )

    def _fail_all(self, error: Callable[[str], Exception]) -> None:
        """Fail every queued or running prompt with `error(request_id)`; free their blocks."""
        with self._wake:
            pending = list(self._pending.values())
            for p in pending:
                self.engine.abort(p.seq.request_id)
            self._pending.clear()
            self._wake.notify()
        for p in pending:
            p.future.set_exception(error(p.seq.request_id))


def _sample_ids(seq: Sequence) -> list[RequestId]:
    """The generator keys a step may draw from for `seq`: one per sample (its first tokens)."""
    return sample_request_ids(seq.request_id, seq.params.num_samples)


def _unix_ms(monotonic_deadline: float, monotonic_now: float) -> int:
    return int((time.time() + (monotonic_deadline - monotonic_now)) * 1000)
