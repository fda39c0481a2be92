"""`TrackedRequest`: one request in flight on the decode worker, from `submit` to its last
delta, and the `Delta`s its stream is handed.

What a sample was sent is one counter, `num_sent[index]` (output tokens reported, the first
token included; a sample not in it was sent its first token by the prefill worker)::

    output tokens:  | sent (num_sent) | new: the next delta |
                                      ^ due once `interval` are new (the first: alone, at once)

Touched under the worker's lock only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.trace import INVALID_SPAN, Span, Tracer, set_span_in_context

from pagedserve.decode_worker.convert import DecodeCall
from pagedserve.decode_worker.kv_import import ImportCancel
from pagedserve.decode_worker.plan import DecodePlan
from pagedserve.decode_worker.streams import AnyStream, Delta
from pagedserve.metrics import PhaseMetrics
from pagedserve.model.requests.sequence import FinishReason, Sequence


@dataclass(slots=True)
class RequestClock:
    """When a request's phases began on this worker (time.monotonic(); 0.0: not yet)."""

    queued: float = 0.0  # its KV ready (imported, or to be computed here)
    scheduled: float = 0.0  # first scheduled
    first_token: float = 0.0  # the first token made here
    last_token: float = 0.0  # the latest token made here

    def observe(self, phases: PhaseMetrics, prefill_here: bool, generated: int) -> None:
        """The request's queue, prefill (computed here only) and decode times, and its tokens."""
        if self.queued and self.scheduled:
            phases.queue.observe(self.scheduled - self.queued)
        start = self.scheduled
        if prefill_here and self.scheduled and self.first_token:
            phases.prefill.observe(self.first_token - self.scheduled)
            start = self.first_token
        if start and self.last_token:
            phases.decode.observe(self.last_token - start)
        phases.generation_tokens.observe(generated)


@dataclass(slots=True, eq=False)
class TrackedRequest:
    """A request's sequence (sample 0), stream, spans, import state and stream progress."""

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
    clock: RequestClock = field(default_factory=RequestClock)

    @classmethod
    def for_call(
        cls, call: DecodeCall, seq: Sequence, stream: AnyStream, span: Span
    ) -> TrackedRequest:
        """The request `call` (sample 0: `seq`), streamed to `stream`, its life in `span`."""
        # NOTE: several samples interleave on one stream: their deltas are not held back
        interval = call.stream_interval if call.num_outputs == 1 else 1
        tracked = cls(seq, stream, span, num_samples=call.num_outputs, interval=interval)
        if call.params.use_beam_search or call.prefill_here:
            # NOTE: the beams' tokens are all sent at the end; a prefill here sends its first
            tracked.num_sent = dict.fromkeys(range(call.num_outputs), 0)
        return tracked

    @property
    def members(self) -> list[Sequence]:
        """Every sample's sequence, by index (sample 0 alone until the fork)."""
        return self.seq.group.members if self.seq.group is not None else [self.seq]

    @property
    def all_ended(self) -> bool:
        return len(self.ended) >= self.num_samples

    def is_due(self, seq: Sequence) -> bool:
        """Whether sample `seq` has a delta to hand out now: its `interval` is full, or it made
        the first token computed here (that one goes alone, at once: TTFT)."""
        sent = self.num_sent.get(seq.sample_index, 1)
        new = seq.num_output_tokens - sent
        return new >= self.interval or (new > 0 and sent == 0)

    def delta(self, seq: Sequence, index: int | None, num_preemptions: int) -> Delta:
        """What `seq` (sample `index`, default its own) made since its last delta; counts it
        sent. `num_preemptions`: the scheduler's count for `seq` (the request reports its most)."""
        index = seq.sample_index if index is None else index
        first_here = self.prefill_here and self.num_sent.get(index, 1) == 0
        new = slice(self.num_sent.get(index, 1), seq.num_output_tokens)
        self.num_sent[index] = seq.num_output_tokens
        self.clock.last_token = time.monotonic()
        if not self.clock.first_token:
            self.clock.first_token = self.clock.last_token
        self.num_preemptions = max(self.num_preemptions, num_preemptions)
        return Delta(
            token_ids=seq.output_token_ids[new],
            logprobs=seq.output_logprobs[new],
            num_generated=seq.num_output_tokens,
            num_preemptions=self.num_preemptions,
            recomputed_prompt=self.recomputed,
            index=index,
            cached_prompt_tokens=seq.num_cached_prompt_tokens if self.prefill_here else 0,
            prompt_logprobs=list(seq.prompt_logprobs) if first_here else [],
        )

    def is_open(self, index: int) -> bool:
        """Whether sample `index` is still to end (a beam search's beams past the n best are
        never returned)."""
        return index not in self.ended and index < self.num_samples

    def last_delta(
        self, seq: Sequence, index: int, num_preemptions: int, error: str | None
    ) -> Delta:
        """Sample `index`'s (finished `seq`'s) last delta; marks it ended. `error`: the message
        of a sample that ended with ERROR."""
        self.ended.add(index)
        delta = self.delta(seq, index, num_preemptions)
        delta.finish_reason = seq.finish_reason
        stop_ids = seq.params.stop_token_ids
        if seq.finish_reason is FinishReason.STOP and seq.token_ids[-1] in stop_ids:
            delta.matched_stop_token_id = seq.token_ids[-1]
        delta.error = error
        return delta

    def start_queue_span(self, tracer: Tracer) -> None:
        """`decode.queue`: from the KV ready (imported, or to be computed here) until the
        request is first scheduled (`trace_plan` ends it)."""
        self.queue_span = tracer.start_span("decode.queue", context=set_span_in_context(self.span))
        self.clock.queued = time.monotonic()

    def observe(self, phases: PhaseMetrics) -> None:
        """Its phase histograms (every sample ended)."""
        generated = sum(m.num_output_tokens for m in self.members)
        self.clock.observe(phases, self.prefill_here, generated)

    def end_spans(self) -> None:
        """End the request's spans (every sample ended), with its usage and outcome."""
        if self.queue_span is not None:
            self.queue_span.end()
        members = self.members
        span = self.span
        span.set_attribute("gen_ai.usage.output_tokens", sum(m.num_output_tokens for m in members))
        span.set_attribute("gen_ai.usage.input_tokens", self.seq.num_prompt_tokens)
        span.set_attribute("pagedserve.num_preemptions", self.num_preemptions)
        span.set_attribute("pagedserve.recomputed_prompt", self.recomputed)
        span.set_attribute("pagedserve.prefill_here", self.prefill_here)
        drafted = sum(m.num_draft_tokens for m in members)
        if drafted:
            span.set_attribute("pagedserve.spec.draft_tokens", drafted)
            span.set_attribute("pagedserve.spec.accepted_tokens",
                               sum(m.num_accepted_tokens for m in members))  # fmt: skip
        reasons = [m.finish_reason.value if m.finish_reason else "unknown" for m in members]
        span.set_attribute("gen_ai.response.finish_reasons", reasons)
        span.end()


def request_of(seq: Sequence) -> str:
    """The request a sequence belongs to: its group's, or its own id."""
    return seq.group.request_id if seq.group is not None else seq.request_id


def trace_plan(plan: DecodePlan, tracked: dict[str, TrackedRequest]) -> None:
    """Span events for what the step did to each request (preempt, swap, recompute); ends the
    `decode.queue` span of each request scheduled for the first time."""
    for item in plan.scheduled:
        request = tracked.get(request_of(item.seq))
        if request is not None and request.queue_span is not None:
            request.queue_span.end()
            request.queue_span = None
            request.clock.scheduled = time.monotonic()
    events = [("preempt", p.seq, {"mode": p.mode.value, "blocks": p.num_blocks})
              for p in plan.preempted]  # fmt: skip
    events += [("swap-in", seq, {}) for seq in plan.swapped_in]
    events += [("recompute", seq, {"reason": "preempted"}) for seq in plan.recomputed]
    for name, seq, attributes in events:
        request = tracked.get(request_of(seq))
        if request is not None:
            request.span.add_event(name, attributes)
            if name == "preempt" and attributes["mode"] == "swap":
                request.span.add_event("swap-out", {"blocks": attributes["blocks"]})
