"""`DecodeWorker`: the decode worker's threads around one `DecodeEngine`.

    caller ── submit ──► inbox ──► loop: import pool (KvImporter: pull or give up) ──► engine
                                  └─► (prefill here) engine.add_sequence
    loop thread ── step() under the lock ──► the step's deltas ──► `publish`: one hand-over
                   to the server's event loop (`AsyncRequestStream`s) per step; a request's
                   delta waits until its `stream_interval` is full (one wake-up per interval)
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

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, set_span_in_context

from pagedserve.core_share import one_torch_thread
from pagedserve.decode_worker.convert import DecodeCall, Delta
from pagedserve.decode_worker.engine import DecodeEngine
from pagedserve.decode_worker.kv_import import (
    ImportCancel,
    KvImporter,
    ProducerClients,
    TransferReport,
)
from pagedserve.errors import InvalidArgument, ResourceExhausted, Unavailable
from pagedserve.grpcutil import EngineLoop
from pagedserve.model.requests.batch import ScheduledSequence
from pagedserve.model.requests.sequence import FinishReason, Sequence, fork_samples
from pagedserve.model.tp_pipes import RankLost
from pagedserve.telemetry import Tracing, setup_tracing
from pagedserve.worker_hooks import NO_HOOKS, WorkerHooks
from pagedserve.worker_load import WorkerLoad

log = logging.getLogger(__name__)


class RequestStream:
    """The deltas of one request, in order, read by a thread (`get`); the last one has
    `finish_reason` set."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._held: Delta | None = None  # read ahead: another sample's

    def put(self, delta: Delta) -> None:
        self._queue.put(delta)

    def get(self, timeout_s: float) -> Delta | None:
        """The next delta merged with any others of its sample already queued; None after
        `timeout_s`."""
        delta, self._held = self._held, None
        if delta is None:
            try:
                delta = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                return None
        while delta.finish_reason is None:
            try:
                later = self._queue.get_nowait()
            except queue.Empty:
                break
            if later.index != delta.index:
                self._held = later
                break
            delta.merge(later)
        return delta


class AsyncRequestStream:
    """The deltas of one request, read on an asyncio event loop (`await get()`). The worker
    hands a step's deltas for every such stream of one loop to that loop in one call
    (`publish`), never one wake-up per stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._held: Delta | None = None  # read ahead: another sample's

    def put(self, delta: Delta) -> None:
        """On the loop's thread only (`publish` gets it there)."""
        self._queue.put_nowait(delta)

    async def get(self, merge: bool = True) -> Delta:
        """The next delta merged with any others of its sample already queued (`merge`)."""
        delta, self._held = self._held, None
        if delta is None:
            delta = await self._queue.get()
        while merge and delta.finish_reason is None and not self._queue.empty():
            later = self._queue.get_nowait()
            if later.index != delta.index:
                self._held = later
                break
            delta.merge(later)
        return delta


AnyStream = RequestStream | AsyncRequestStream


def publish(items: list[tuple[AnyStream, Delta]]) -> None:
    """Deliver deltas from the engine's thread: thread streams at once, asyncio streams in one
    `call_soon_threadsafe` per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AnyStream, Delta]]] = {}
    for stream, delta in items:
        if isinstance(stream, AsyncRequestStream):
            by_loop.setdefault(stream.loop, []).append((stream, delta))
        else:
            stream.put(delta)
    for loop, batch in by_loop.items():
        # NOTE: a closed loop raises RuntimeError: the server is gone, nobody reads these
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, batch)


def _request_of(seq: Sequence) -> str:
    """The request a sequence belongs to: its group's, or its own id."""
    return seq.group.request_id if seq.group is not None else seq.request_id


def _put_all(batch: list[tuple[AnyStream, Delta]]) -> None:
    for stream, delta in batch:
        stream.put(delta)


@dataclass(slots=True, eq=False)
class _Tracked:
    seq: Sequence
    stream: AnyStream
    span: Span = INVALID_SPAN  # decode.run: the request's life on this worker
    queue_span: Span | None = None  # decode.queue: KV ready until first scheduled
    importing: bool = True
    cancel: ImportCancel = field(default_factory=ImportCancel)  # stops the import's pull
    recomputed: bool = False
    prefill_here: bool = False  # no prefill worker: the prompt and first token are made here
    generator_restarted: bool = False  # prefill here, seeded: restarted after the first token
    aborted: bool = False
    num_samples: int = 1
    num_sent: dict[int, int] = field(default_factory=dict)  # by sample: output tokens reported
    interval: int = 1  # stream_interval: the least new tokens per delta (but the first, last)
    ended: set[int] = field(default_factory=set)  # samples whose last delta was sent
    num_preemptions: int = 0

    @property
    def members(self) -> list[Sequence]:
        """Every sample's sequence, by index (sample 0 alone until the fork)."""
        return self.seq.group.members if self.seq.group is not None else [self.seq]


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
    ) -> None:
        self.engine = engine
        self.tracing = tracing or setup_tracing("pagedserve-decode", None)
        self.worker_id = worker_id
        self.lock = threading.RLock()
        self.importer = KvImporter(engine, self.lock, producers or ProducerClients())
        self.draining = False
        self._work = threading.Event()  # set by submit, imports and close: the loop looks again
        self._inbox: queue.SimpleQueue[tuple[_Tracked, DecodeCall]] = queue.SimpleQueue()
        self._ids_lock = threading.Lock()  # NOTE: guards `_queued` and additions to `_tracked`
        self._queued: set[str] = set()  # request ids submitted and still in the inbox
        self._stepping = False  # a step holds the lock (submit leaves its request in the inbox)
        self._tracked: dict[str, _Tracked] = {}
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
        seq = self._new_sequence(call)
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
        # NOTE: several samples interleave on one stream: their deltas are not held back
        interval = call.stream_interval if call.num_outputs == 1 else 1
        tracked = _Tracked(seq, stream, span, num_samples=call.num_outputs, interval=interval)
        if call.params.use_beam_search or call.prefill_here:
            # NOTE: the beams' tokens are all sent at the end; a prefill here sends its first
            tracked.num_sent = dict.fromkeys(range(call.num_outputs), 0)
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

    def _start(self, tracked: _Tracked, call: DecodeCall) -> None:
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

    def _prefill_here(self, tracked: _Tracked) -> None:
        """Queue a request no prefill worker ran: its prompt is computed by this engine's
        steps (chunked, beside the running decodes) like a recompute (lock held)."""
        tracked.importing = False
        tracked.prefill_here = True
        tracked.span.add_event("prefill-here", {"prompt_tokens": tracked.seq.num_prompt_tokens})
        tracked.queue_span = self.tracing.tracer.start_span(
            "decode.queue", context=set_span_in_context(tracked.span)
        )
        self.engine.add_sequence(tracked.seq)

    def _restart_generators(self, tracked: _Tracked, seq: Sequence) -> None:
        """A seeded request prefilled here draws its second token from a generator restarted
        from the seed, as when a prefill worker drew the first: its tokens do not depend on
        the route (lock held)."""
        if seq.num_output_tokens >= 1:
            tracked.generator_restarted = True
            if seq.params.seed is not None:
                self.engine.runner.sampler.remove(seq.request_id)

    def _new_sequence(self, call: DecodeCall) -> Sequence:
        engine = self.engine
        if call.prefill_here and (call.num_samples > 1 or call.params.use_beam_search):
            raise InvalidArgument("prefill_here", "only for one sample without beam search")
        try:
            seq = engine.new_sequence(
                call.prompt_token_ids,
                call.params,
                request_id=call.request_id,
                priority=call.priority,
                cache_salt=call.cache_salt,
            )
        except InvalidArgument as exc:
            prefix = "request" if exc.field == "prompt_token_ids" else "request.sampling"
            raise exc.with_prefix(prefix) from None
        vocab = engine.model_config.vocab_size
        if call.first_token >= vocab:
            raise InvalidArgument("first_token", f"{call.first_token} is not < {vocab}")
        self._check_samples(call, vocab)
        if not engine.would_fit(seq.num_prompt_tokens, call.params.max_tokens, call.num_samples):
            raise ResourceExhausted(
                f"request needs more than this decode worker's {engine.pool.num_blocks} KV "
                f"blocks of {engine.pool.block_size}; lower max_tokens or use a larger worker"
            )
        if not (call.params.use_beam_search or call.prefill_here):
            # NOTE: the first beam step chooses the tokens; a prefill here samples the first
            seq.append_token(call.first_token, call.first_logprobs)
        return seq

    @staticmethod
    def _check_samples(call: DecodeCall, vocab: int) -> None:
        """`samples`: every sample's first token, or a beam search's first candidates."""
        params, samples = call.params, call.samples
        if any(token >= vocab for token, _ in samples):
            raise InvalidArgument("samples", f"a token is not < {vocab}")
        if params.use_beam_search:
            if len(samples) < min(params.beam_size, vocab) or any(lp is None for _, lp in samples):
                raise InvalidArgument(
                    "samples", f"a beam search of {params.beam_size} beams needs at least as "
                    "many candidates (token, logprob)"
                )  # fmt: skip
            return
        if call.num_samples > 1 and len(samples) != call.num_samples:
            raise InvalidArgument(
                "samples", f"{call.num_samples} samples asked, {len(samples)} first tokens given"
            )
        if call.num_samples == 1 and samples:
            raise InvalidArgument("samples", "given for a request with one sample")
        if samples and samples[0][0] != call.first_token:
            raise InvalidArgument("samples", "samples[0] must repeat first_token")

    def _import(self, tracked: _Tracked, call: DecodeCall) -> None:
        report = TransferReport()
        with self.tracing.tracer.start_span(
            "kv.transfer", context=set_span_in_context(tracked.span)
        ) as transfer:
            try:
                reason = self.importer.import_kv(tracked.seq, call.handle, report, tracked.cancel)
            except Exception:
                log.exception("%s: KV import failed", call.request_id)
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
            tracked.queue_span = self.tracing.tracer.start_span(
                "decode.queue", context=set_span_in_context(tracked.span)
            )
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

    def _end_all(self, tracked: _Tracked, reason: FinishReason, error: str | None = None) -> None:
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
            log.error("%s: failed alone after a failed step; ending it with ERROR", seq.request_id)
            self.engine.abort(seq.request_id)
            seq.finish(FinishReason.ERROR)
            self.engine.errors[seq.request_id] = f"{seq.request_id}: decode step failed"
            tracked = self._tracked.get(_request_of(seq))
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
            self._trace_plan(out.plan)
            for seq in out.finished:
                tracked = self._tracked.get(_request_of(seq))
                if tracked is not None:
                    self._finish(tracked, seq)
            for item in out.plan.scheduled:
                seq = item.seq
                tracked = self._tracked.get(_request_of(seq))
                if tracked is None or seq.sample_index in tracked.ended:
                    continue
                if seq.params.use_beam_search:
                    continue  # NOTE: beams change until the search ends: sent at the end
                if tracked.prefill_here and not tracked.generator_restarted:
                    self._restart_generators(tracked, seq)
                sent = tracked.num_sent.get(seq.sample_index, 1)
                new = seq.num_output_tokens - sent
                # NOTE: stream_interval: a delta (and a wake-up of its reader) only once the
                # interval is full; the first token computed here goes alone, at once (TTFT)
                if new >= tracked.interval or (new > 0 and sent == 0):
                    self._outbox.append((tracked.stream, self._delta(tracked, seq)))
            self._flush()
            return not out.plan.is_empty

    def _trace_plan(self, plan) -> None:
        """Span events for what the step did to each request (preempt, swap, recompute)."""
        for item in plan.scheduled:
            tracked = self._tracked.get(_request_of(item.seq))
            if tracked is not None and tracked.queue_span is not None:
                tracked.queue_span.end()
                tracked.queue_span = None
        events = [("preempt", p.seq, {"mode": p.mode.value, "blocks": p.num_blocks})
                  for p in plan.preempted]  # fmt: skip
        events += [("swap-in", seq, {}) for seq in plan.swapped_in]
        events += [("recompute", seq, {"reason": "preempted"}) for seq in plan.recomputed]
        for name, seq, attributes in events:
            tracked = self._tracked.get(_request_of(seq))
            if tracked is not None:
                tracked.span.add_event(name, attributes)
                if name == "preempt" and attributes["mode"] == "swap":
                    tracked.span.add_event("swap-out", {"blocks": attributes["blocks"]})

    def _delta(self, tracked: _Tracked, seq: Sequence, index: int | None = None) -> Delta:
        """What `seq` (sample `index`, default its own) made since its last delta."""
        index = seq.sample_index if index is None else index
        new = slice(tracked.num_sent.get(index, 1), seq.num_output_tokens)
        tracked.num_sent[index] = seq.num_output_tokens
        tracked.num_preemptions = max(
            tracked.num_preemptions, self.engine.scheduler.num_preemptions_of(seq.request_id)
        )
        return Delta(
            token_ids=seq.output_token_ids[new],
            logprobs=seq.output_logprobs[new],
            num_generated=seq.num_output_tokens,
            num_preemptions=tracked.num_preemptions,
            recomputed_prompt=tracked.recomputed,
            index=index,
            cached_prompt_tokens=seq.num_cached_prompt_tokens if tracked.prefill_here else 0,
        )

    def _finish(self, tracked: _Tracked, seq: Sequence, index: int | None = None) -> None:
        """Send sample `seq`'s last delta; forget the request once every sample has ended
        (lock held)."""
        index = seq.sample_index if index is None else index
        if index in tracked.ended or index >= tracked.num_samples:
            return  # NOTE: a beam search's beams past the n best are not returned
        tracked.ended.add(index)
        delta = self._delta(tracked, seq, index)
        delta.finish_reason = seq.finish_reason
        if (
            seq.finish_reason is FinishReason.STOP
            and seq.token_ids[-1] in seq.params.stop_token_ids
        ):
            delta.matched_stop_token_id = seq.token_ids[-1]
        if seq.finish_reason is FinishReason.ERROR:
            delta.error = self.engine.errors.pop(seq.request_id, "decode failed")
        self._outbox.append((tracked.stream, delta))
        if len(tracked.ended) < tracked.num_samples:
            return
        del self._tracked[_request_of(tracked.seq)]
        if tracked.queue_span is not None:
            tracked.queue_span.end()
        members = tracked.members
        output_tokens = sum(m.num_output_tokens for m in members)
        seq = tracked.seq
        tracked.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        tracked.span.set_attribute("gen_ai.usage.input_tokens", seq.num_prompt_tokens)
        tracked.span.set_attribute("pagedserve.num_preemptions", tracked.num_preemptions)
        tracked.span.set_attribute("pagedserve.recomputed_prompt", tracked.recomputed)
        tracked.span.set_attribute("pagedserve.prefill_here", tracked.prefill_here)
        reasons = [m.finish_reason.value if m.finish_reason else "unknown" for m in members]
        tracked.span.set_attribute("gen_ai.response.finish_reasons", reasons)
        tracked.span.end()

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
