"""`DecodeWorker`: the decode worker's threads around one `DecodeEngine`.

    caller ── submit ──► inbox ──► loop: import pool (KvImporter: pull or give up) ──► engine
                                  └─► (prefill here) engine.add_sequence
    loop thread ── step() under the lock ──► the step's deltas ──► `publish`: one hand-over
                   to the server's event loop (`AsyncRequestStream`s) per step; a request's
                   delta waits until its `stream_interval` is full (one wake-up per interval)
                   └─► the step's block events (KV imports' since the last step too) ──►
                       `on_events`: the prefix index's publisher, which only queues them
    caller ── abort / cancel ──► engine.abort under the lock: blocks freed at once

`submit` validates and queues the request in the inbox, and starts it at once unless a step
is running; then the loop (or an abort) takes what is there before the next step. NOTE: it
used to wait for the lock, so a burst of submits entered one or two per step: with steps of
seconds (prompts prefilled here) 33 requests took many steps to reach the engine. `abort`
blocks on `lock` for at most one step, so the server calls it off its event loop.

The engine and its scheduler are single-threaded: every call into them holds `lock`, which the
loop holds for a whole `step()`. So an abort waits at most one step, and an import's pool
bookkeeping never races a step. The request is never lost: an import that fails for any reason
queues the sequence for local recompute (`recomputed_prompt`).

A step that raises is isolated (`_isolate_failure`): each running sequence is re-run alone, and
only those that fail alone end with ERROR; the others go on. If the loop thread itself dies,
`dead` is set, `on_loop_death` runs (the server flips health to NOT_SERVING) and every request
in flight ends with ERROR.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from opentelemetry.context import Context
from opentelemetry.trace import set_span_in_context

from pagedserve.core_share import one_torch_thread
from pagedserve.decode_worker import convert
from pagedserve.decode_worker.convert import DecodeCall
from pagedserve.decode_worker.engine import DecodeEngine
from pagedserve.decode_worker.kv_import import KvImporter, ProducerClients, TransferReport
from pagedserve.decode_worker.streams import AnyStream, Delta, RequestStream, publish
from pagedserve.decode_worker.tracked import TrackedRequest, request_of, trace_plan
from pagedserve.errors import InvalidArgument, Unavailable
from pagedserve.grpcutil import EngineLoop
from pagedserve.kvstore.block_pool import BlockEvent, Tier
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.metrics import PhaseMetrics
from pagedserve.model.requests.batch import ScheduledSequence
from pagedserve.model.requests.sequence import FinishReason, Sequence, fork_samples
from pagedserve.model.tp_pipes import RankLost
from pagedserve.telemetry import Tracing, setup_tracing
from pagedserve.worker_hooks import NO_HOOKS, WorkerHooks
from pagedserve.worker_load import WorkerLoad

log = logging.getLogger(__name__)


class DecodeWorker:
    """Owns the engine's threads and every request from `submit` to its last delta."""

    def __init__(
        self,
        engine: DecodeEngine,
        *,
        worker_id: str = "decode",
        import_threads: int = 4,
        producers: ProducerClients | None = None,
        tracing: Tracing | None = None,
        hooks: WorkerHooks = NO_HOOKS,
        on_events: Callable[[list[BlockEvent]], None] | None = None,
    ) -> None:
        """`on_events`: gets each step's block events (the prefix index's publisher); called
        on the loop thread with the lock held, it must not block."""
        self.engine = engine
        self.on_events = on_events
        self.tracing = tracing or setup_tracing("pagedserve-decode", None)
        self.phases: PhaseMetrics | None = None  # the server's histograms (none in tests)
        self.worker_id = worker_id
        self.lock = threading.RLock()
        self.importer = KvImporter(engine, self.lock, producers or ProducerClients())
        self.draining = False
        self._work = threading.Event()  # set by submit, imports and close: the loop looks again
        self._inbox: queue.SimpleQueue[tuple[TrackedRequest, DecodeCall]] = queue.SimpleQueue()
        self._ids_lock = threading.Lock()  # NOTE: guards `_queued` and additions to `_tracked`
        self._queued: set[str] = set()  # request ids submitted and still in the inbox
        self._stepping = False  # a step holds the lock (submit leaves its request in the inbox)
        self._tracked: dict[str, TrackedRequest] = {}
        self._outbox: list[tuple[AnyStream, Delta]] = []  # deltas to publish (lock held)
        self._last_load: WorkerLoad  # as of the last flush (each step's end) or load() that ran
        self._imports = ThreadPoolExecutor(
            import_threads, thread_name_prefix="kv-import", initializer=one_torch_thread
        )
        # NOTE: a server runs the loop on the main thread (WorkerHooks.engine_loop)
        self.engine_loop = hooks.engine_loop or EngineLoop("decode-loop")
        self.core_share = hooks.core_share
        self.on_loop_death = hooks.on_loop_death
        self._stop = False
        self.dead = False  # the loop thread died: this worker can serve nothing more
        self.death: BaseException | None = None  # what killed the loop
        with self.lock:
            self._last_load = self._load_locked()

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self, call: DecodeCall, parent: Context | None = None, stream: AnyStream | None = None
    ) -> AnyStream:
        """Start a request: import (or recompute) its prompt, then stream its tokens to
        `stream` (a new thread-read `RequestStream` when None), which it returns.

        `parent` is the caller's trace context (the `decode.run` span's parent). Raises
        InvalidArgument naming the field, ResourceExhausted for a request this worker can never
        hold, Unavailable while draining.
        """
        if self.draining or self.dead:
            raise Unavailable("decode worker is draining" if not self.dead else "engine stopped")
        seq = convert.new_sequence(call, self.engine)
        stream = stream if stream is not None else RequestStream()
        span = self.tracing.tracer.start_span(
            "decode.run",
            context=parent,
            attributes={
                "pagedserve.request_id": call.request_id,
                "gen_ai.request.max_tokens": call.params.max_tokens,
                "pagedserve.worker_id": self.worker_id,
            },
        )
        tracked = TrackedRequest.for_call(call, seq, stream, span)
        with self._ids_lock:
            if call.request_id in self._queued or call.request_id in self._tracked:
                span.end()
                raise InvalidArgument("request.request_id", f"{call.request_id!r} is in flight")
            self._queued.add(call.request_id)
        self._inbox.put((tracked, call))
        if not self._stepping:  # NOTE: no step to wait for (rarely one starts now): start it
            with self.lock:
                self._take_inbox()
        self._work.set()
        return stream

    def _take_inbox(self) -> None:
        """Start every request submitted since the last look (lock held)."""
        started = False
        while True:
            try:
                tracked, call = self._inbox.get_nowait()
            except queue.Empty:
                break
            with self._ids_lock:  # NOTE: tracked before unqueued: a duplicate is always seen
                self._tracked[call.request_id] = tracked
                self._queued.discard(call.request_id)
            self._start(tracked, call)
            started = True
        if started:
            self._work.set()  # NOTE: an abort may have taken them while the loop sleeps

    def _start(self, tracked: TrackedRequest, call: DecodeCall) -> None:
        """Import the prompt's KV on the import pool, or queue its prefill here (lock held)."""
        seq = tracked.seq
        if call.prefill_here:
            self._prefill_here(tracked)
            return
        if call.num_samples == 1 and seq.check_stop(
            self.engine.model_config.eos_token_ids, self.engine.max_model_len
        ):
            self._finish(tracked, seq)  # NOTE: the first token already ended it
            self._flush()
            return
        try:
            self._imports.submit(self._import, tracked, call)
        except RuntimeError:  # NOTE: the import pool is shut down: the worker is closing
            tracked.importing = False
            self._end_all(tracked, FinishReason.ERROR, "decode worker is stopping")
            self._flush()

    def _prefill_here(self, tracked: TrackedRequest) -> None:
        """Queue a request no prefill worker ran: its prompt is computed by this engine's
        steps (chunked, beside the running decodes) like a recompute (lock held)."""
        tracked.importing = False
        tracked.prefill_here = True
        tracked.span.add_event("prefill-here", {"prompt_tokens": tracked.seq.num_prompt_tokens})
        tracked.start_queue_span(self.tracing.tracer)
        self.engine.add_sequence(tracked.seq)

    def _restart_generators(self, tracked: TrackedRequest, seq: Sequence) -> None:
        """A seeded request prefilled here draws its second token from a generator restarted
        from the seed, as when a prefill worker drew the first: its tokens do not depend on
        the route (lock held)."""
        if seq.num_output_tokens >= 1:
            tracked.generator_restarted = True
            if seq.params.seed is not None:
                self.engine.runner.sampler.remove(seq.request_id)

    def _import(self, tracked: TrackedRequest, call: DecodeCall) -> None:
        report = TransferReport()
        with self.tracing.tracer.start_span(
            "kv.transfer", context=set_span_in_context(tracked.span)
        ) as transfer:
            try:
                reason = self.importer.import_kv(tracked.seq, call.handle, report, tracked.cancel)
            except Exception:
                log.exception(
                    "%s: KV import failed", call.request_id, extra={"request_id": call.request_id}
                )
                with self.lock:
                    self.engine.kv.free(tracked.seq.block_table)
                reason = report.outcome = "import error"
            transfer.set_attributes(
                {
                    "pagedserve.kv.transport": report.transport,
                    "pagedserve.kv.blocks_pulled": report.blocks_pulled,
                    "pagedserve.kv.blocks_skipped": report.blocks_skipped,
                    "pagedserve.kv.bytes": report.bytes,
                    "pagedserve.kv.outcome": report.outcome,
                }
            )
        with self.lock:
            tracked.importing = False
            if tracked.aborted:
                self.engine.kv.free(tracked.seq.block_table)
                return
            if reason is not None:
                tracked.span.add_event("recompute", {"reason": reason})
            tracked.recomputed = reason is not None
            tracked.start_queue_span(self.tracing.tracer)
            if reason is not None:
                self.engine.kv.free(tracked.seq.block_table)  # NOTE: a no-op unless partial
                tracked.seq.num_computed_tokens = 0
            if call.params.use_beam_search:
                candidates = [(t, lp.logprob) for t, lp in call.samples if lp is not None]
                done = self.engine.add_beam_request(
                    tracked.seq, candidates, prefilled=reason is None
                )
                for seq in done:
                    self._finish(tracked, seq)
                self._flush()
            elif call.num_samples > 1:
                # NOTE: fork after the import: every sample shares the prompt's blocks
                samples = fork_samples(tracked.seq, list(call.samples[1:]))
                done = self.engine.add_samples(tracked.seq, samples, prefilled=reason is None)
                for seq in done:
                    self._finish(tracked, seq)
                self._flush()
            elif reason is None:
                self.engine.add_prefilled(tracked.seq)
            else:
                self.engine.add_sequence(tracked.seq)
        self._work.set()

    def abort(self, request_id: str, stream: AnyStream | None = None) -> bool:
        """Abort a request (only if its stream is `stream`, when given); its blocks are freed
        now, or as soon as its import returns. False if unknown or already finished."""
        with self.lock:
            self._take_inbox()
            tracked = self._tracked.get(request_id)
            if tracked is None and stream is None:
                return self._abort_sample(request_id)
            if tracked is None or (stream is not None and tracked.stream is not stream):
                return False
            if tracked.importing:
                tracked.aborted = True
                tracked.cancel.cancel()  # NOTE: the import frees its blocks, then the lease
            else:
                self.engine.abort(request_id)
            self._end_all(tracked, FinishReason.ABORT)
            self._flush()
            return True

    def _abort_sample(self, sample_id: str) -> bool:
        """Abort one sample of a running multi-sample request (`<request>#<index>`, index 0
        too: the router ends a sample whose stop string matched); the others go on (lock
        held). A beam search's beams end together only."""
        request_id, _, index = sample_id.rpartition("#")
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.importing or not index.isdigit():
            return False
        members, i = tracked.members, int(index)
        if i >= len(members) or i in tracked.ended or members[i].params.use_beam_search:
            return False
        self.engine.abort_one(members[i].request_id)
        members[i].finish(FinishReason.ABORT)
        self._finish(tracked, members[i])
        self._flush()
        return True

    def _end_all(
        self, tracked: TrackedRequest, reason: FinishReason, error: str | None = None
    ) -> None:
        """Finish every sample of `tracked` not yet ended with `reason` (lock held)."""
        for index in range(tracked.num_samples):
            if index in tracked.ended:
                continue
            members = tracked.members
            seq = members[index] if index < len(members) else tracked.seq
            if not seq.is_finished or seq.finish_reason is not reason:
                seq.finish(reason)
            if error is not None:
                self.engine.errors[seq.request_id] = error
            self._finish(tracked, seq, index)

    # -- loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine_loop.start(self._run)

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    self._take_inbox()
                    if self._stop:
                        return
                    busy = self.engine.has_unfinished
                    if self.core_share is not None and busy:
                        self.core_share.busy()
                    elif self.core_share is not None:
                        self.core_share.idle()
                    progressed = busy and self._step_isolated()
                    if not progressed:
                        self.engine.runner.check_ranks()  # NOTE: a dead rank kills the loop
                if progressed:
                    # NOTE: let import and RPC threads waiting on the lock in before the next step
                    time.sleep(0)
                else:
                    # NOTE: idle, or nothing fits while KV imports hold blocks: a submit, an
                    # import or close wakes us (an event set before the wait is not lost)
                    self._work.wait(0.01 if busy else 0.5)
                    self._work.clear()
        except BaseException as exc:
            log.exception("decode loop died; failing every request")
            self.death = exc
            self._die(exc)

    def _step_isolated(self) -> bool:
        """`step()`; a step that raises is isolated (`_isolate_failure`). Lock held."""
        try:
            return self.step()
        except RankLost:
            raise  # NOTE: not the requests' fault: the loop dies, health NOT_SERVING
        except Exception:
            log.exception("decode step failed; isolating the failing request")
            self._isolate_failure()
            return True

    def _isolate_failure(self) -> None:
        """After a failed step (its sequences not advanced): end with ERROR only the running
        sequences that fail when run alone; if none does, the step itself is broken and every
        request fails. Lock held by the caller."""
        running = [entry.seq for entry in self.engine.scheduler.running]
        culprits = [seq for seq in running if not self._runs_alone(seq)]
        if not culprits:
            self._fail_all()
            return
        for seq in culprits:
            log.error(
                "%s: failed alone after a failed step; ending it with ERROR", seq.request_id,
                extra={"request_id": seq.request_id},
            )  # fmt: skip
            self.engine.abort(seq.request_id)
            seq.finish(FinishReason.ERROR)
            self.engine.errors[seq.request_id] = f"{seq.request_id}: decode step failed"
            tracked = self._tracked.get(request_of(seq))
            if tracked is not None:
                self._finish(tracked, seq)
        self._flush()

    def _runs_alone(self, seq: Sequence) -> bool:
        """Re-run `seq`'s pending tokens alone (results dropped). False if that raises.

        NOTE: safe because a failed step advanced nothing and allocation is idempotent: the next
        step writes the same KV slots again. The sequence's generator is restored, so a seeded
        request draws the same tokens as without the probe.
        """
        table = seq.block_table
        pending = seq.num_tokens - seq.num_computed_tokens
        if pending <= 0 or seq.num_tokens > len(table.block_ids) * table.block_size:
            return True  # nothing allocated to probe: not blamed
        runner = self.engine.runner
        states = runner.sampler.save([seq.request_id])
        try:
            runner.execute([ScheduledSequence(seq, pending)])
        except Exception:
            return False
        finally:
            runner.sampler.restore(states)
        return True

    def _die(self, death: BaseException) -> None:
        self.dead = True
        if self.on_loop_death is not None:
            self.on_loop_death(death)
        self._fail_all()

    def step(self) -> bool:
        """One engine step and its deltas (the loop's body; tests may call it directly).

        Returns False when the step did nothing (every block is held by KV imports)."""
        with self.lock:
            self._take_inbox()
            self._stepping = True
            try:
                out = self.engine.step()
            finally:
                self._stepping = False
            if out.events and self.on_events is not None:
                self.on_events(out.events)
            trace_plan(out.plan, self._tracked)
            for seq in out.finished:
                tracked = self._tracked.get(request_of(seq))
                if tracked is not None:
                    self._finish(tracked, seq)
            for item in out.plan.scheduled:
                seq = item.seq
                tracked = self._tracked.get(request_of(seq))
                if tracked is None or seq.sample_index in tracked.ended:
                    continue
                if seq.params.use_beam_search:
                    continue  # NOTE: beams change until the search ends: sent at the end
                if tracked.prefill_here and not tracked.generator_restarted:
                    self._restart_generators(tracked, seq)
                # NOTE: stream_interval: a delta (and a wake-up of its reader) only once due
                if tracked.is_due(seq):
                    self._outbox.append((tracked.stream, self._delta(tracked, seq)))
            self._flush()
            return not out.plan.is_empty

    def _delta(self, tracked: TrackedRequest, seq: Sequence, index: int | None = None) -> Delta:
        """What `seq` (sample `index`, default its own) made since its last delta."""
        return tracked.delta(seq, index, self.engine.scheduler.num_preemptions_of(seq.request_id))

    def _finish(self, tracked: TrackedRequest, seq: Sequence, index: int | None = None) -> None:
        """Send sample `seq`'s last delta; forget the request once every sample has ended
        (lock held)."""
        index = seq.sample_index if index is None else index
        if not tracked.is_open(index):
            return  # NOTE: a beam search's beams past the n best are not returned
        error = None
        if seq.finish_reason is FinishReason.ERROR:
            error = self.engine.errors.pop(seq.request_id, "decode failed")
        preemptions = self.engine.scheduler.num_preemptions_of(seq.request_id)
        self._outbox.append((tracked.stream, tracked.last_delta(seq, index, preemptions, error)))
        if tracked.all_ended:
            del self._tracked[request_of(tracked.seq)]
            tracked.end_spans()
            if self.phases is not None:
                tracked.observe(self.phases)

    def _flush(self) -> None:
        """Publish the deltas queued so far (lock held): one hand-over per step.

        The load snapshot is taken first: a client that saw a delta and then asks `GetLoad`
        while the next step holds the lock gets a load at least as new as that delta."""
        self._last_load = self._load_locked()
        items, self._outbox = self._outbox, []
        if items:
            publish(items)

    def _fail_all(self) -> None:
        with self.lock:
            self._take_inbox()
            for request_id, tracked in list(self._tracked.items()):
                if not tracked.importing:
                    self.engine.abort(request_id)
                else:
                    tracked.aborted = True
                    tracked.cancel.cancel()
                self._end_all(tracked, FinishReason.ERROR, "decode step failed")
            self._flush()

    # -- state ---------------------------------------------------------------------------------

    def registered_hashes(self) -> dict[BlockHash, Tier]:
        """Hashes of every block a prefix hit could use now, with the tier holding each (the
        device pool, the host or disk tier), for republishing the index."""
        with self.lock:
            return self.engine.kv.held_hashes()

    @property
    def num_in_flight(self) -> int:
        with self.lock:
            return len(self._tracked) + self._inbox.qsize()

    def load(self, max_wait_s: float | None = None) -> WorkerLoad:
        """The load now. With `max_wait_s`, a caller that would wait longer for the lock (a
        step holds it) gets the load as of the end of the last step instead: a load poll never
        waits behind a step (slow is not dead, and GetClusterStatus stays quick). 0 never
        waits (safe on an event loop)."""
        if max_wait_s is None:
            self.lock.acquire()
        elif not self.lock.acquire(timeout=max_wait_s):
            return dataclasses.replace(self._last_load, draining=self.draining or self.dead)
        try:
            self._last_load = self._load_locked()
            return self._last_load
        finally:
            self.lock.release()

    def _load_locked(self) -> WorkerLoad:
        pool, scheduler = self.engine.pool, self.engine.scheduler
        importing = sum(t.importing for t in self._tracked.values())
        stats = self.importer.stats
        looked_up = stats.blocks_looked_up
        hits = stats.blocks_reused + stats.blocks_shared_in_flight
        return WorkerLoad(
            num_requests_running=len(scheduler.running),
            num_requests_waiting=len(scheduler.waiting) + importing + self._inbox.qsize(),
            num_requests_swapped=len(scheduler.swapped),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_free,
            kv_blocks_cached=pool.num_cached,
            kv_cache_usage=pool.usage,
            prefix_cache_hit_rate=hits / looked_up if looked_up else 0.0,
            draining=self.draining or self.dead,
            reported_at_unix_ms=int(time.time() * 1000),
            accepts_prefill_here=True,
            tensor_parallel_size=self.engine.config.tensor_parallel_size,
        )

    def close(self) -> None:
        """Stop the loop and the import threads; requests still in flight are dropped."""
        self._imports.shutdown(wait=True, cancel_futures=True)
        self._stop = True
        self._work.set()
        self.engine_loop.join(10)
        self.importer.close()
        self.engine.close()
