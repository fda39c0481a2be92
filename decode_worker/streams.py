"""The decode worker's client-facing streams: the `Delta`s a step hands out, and where they go.

    engine loop (lock held) ── one (stream, Delta) per request that is due ──► `publish`
        RequestStream       put at once; a thread reads it (`get(timeout_s)`)
        AsyncRequestStream  every such stream of one event loop in ONE `call_soon_threadsafe`
                            per step; a coroutine reads it (`await get()`)

A reader merges the deltas of one sample already queued into one (`Delta.merge`). The servicer
turns a delta into a `DecodeResponse` (convert.py); a `DeliveredStream` (delivery.py) is an
`AsyncRequestStream` that batches them on a Deliver stream instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from dataclasses import dataclass, field

from pagedserve.model.requests.batch import TokenLogprobs
from pagedserve.model.requests.sequence import FinishReason


@dataclass(slots=True)
class Delta:
    """What is new for one request since its previous delta (one `DecodeResponse`)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    num_generated: int  # cumulative, first token included
    num_preemptions: int
    recomputed_prompt: bool
    finish_reason: FinishReason | None = None
    matched_stop_token_id: int | None = None
    error: str | None = None  # set with FinishReason.ERROR: the status message
    index: int = 0  # the sample it is about
    cached_prompt_tokens: int = 0  # prefill here: prompt tokens its prefix cache served
    # prefill here, on the first delta: the prompt logprobs asked for (prompt tokens 1 ..)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def merge(self, later: Delta) -> None:
        """Fold a later delta of the same request and sample into this one."""
        if later.index != self.index:
            raise ValueError(f"merge: sample {later.index} into sample {self.index}")
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.num_generated = later.num_generated
        self.num_preemptions = later.num_preemptions
        self.recomputed_prompt = later.recomputed_prompt
        self.finish_reason = later.finish_reason
        self.matched_stop_token_id = later.matched_stop_token_id
        self.error = later.error
        self.cached_prompt_tokens = later.cached_prompt_tokens
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs


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


def _put_all(batch: list[tuple[AnyStream, Delta]]) -> None:
    for stream, delta in batch:
        stream.put(delta)
