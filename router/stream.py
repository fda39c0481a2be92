"""The client's stream: the prefill worker's first token and the decode worker's stream, merged
into `GenerateResponse`s.

    PrefillResponse ─► from_prefill ─┐
                                     ├─► token delta + text delta + cumulative usage (+ finish)
    DecodeResponse* ─► from_decode ──┘

A request the decode worker prefilled itself (`Decision.prefill_here`) has no PrefillResponse:
its first token comes in the decode stream.

Stop strings are matched here (the router detokenizes); stop tokens, eos and length come
finished from the workers. A non-streaming request gets one message, `merge` of the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.internal.v1 import decode_pb2, prefill_pb2
from pagedserve.router.convert import RouterRequest
from pagedserve.router.detokenizer import Detokenizer
from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.v1 import common_pb2, generation_pb2


@dataclass(slots=True)
class ClientStream:
    """Builds one request's GenerateResponses: token deltas, text deltas, usage, the finish.

    `finished` turns True on the message that ends the stream; the caller sends that message
    through `finish` (which flushes the detokenizer) and stops reading the workers."""

    req: RouterRequest
    tokenizer: RouterTokenizer
    cached_tokens: int
    completion_tokens: int = 0
    finished: bool = False
    detok: Detokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.detok = Detokenizer(
            self.tokenizer, skip_special_tokens=self.req.params.skip_special_tokens,
            stop=self.req.params.stop,
        )  # fmt: skip

    @property
    def token_ids(self) -> list[int]:
        """Every token the client has been sent (the first one included)."""
        return self.detok.token_ids

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_tokens,
        )

    def empty(self) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=self.req.request_id, usage=self.usage())

    def from_prefill(
        self, prefilled: prefill_pb2.PrefillResponse
    ) -> generation_pb2.GenerateResponse:
        """The first token (computed by the prefill worker)."""
        token = prefilled.first_token
        stop_token = token if token in self.req.params.stop_token_ids else None
        out = self.add([token], [prefilled.logprobs], prefilled.finish_reason, stop_token)
        return self.with_prompt_logprobs(out, prefilled.prompt_logprobs)

    def from_decode(self, part: decode_pb2.DecodeResponse) -> generation_pb2.GenerateResponse:
        """One message of the decode worker's stream."""
        prefilled_here = not self.token_ids  # NOTE: its first token comes from the decode worker
        if part.cached_prompt_tokens and prefilled_here:
            self.cached_tokens = part.cached_prompt_tokens
        stop_token = part.matched_stop_token_id if part.HasField("matched_stop_token_id") else None
        out = self.add(list(part.token_ids), list(part.logprobs), part.finish_reason, stop_token)
        return self.with_prompt_logprobs(out, part.prompt_logprobs) if prefilled_here else out

    def with_prompt_logprobs(
        self, out: generation_pb2.GenerateResponse, computed: Sequence[common_pb2.Logprobs]
    ) -> generation_pb2.GenerateResponse:
        """`out` (the first message) with the prompt logprobs, when the request asked for
        them: the first prompt token's entry (no logprob: token only), then the worker's."""
        if self.req.params.prompt_logprobs is None:
            return out
        first = common_pb2.TokenLogprob(token_id=self.req.prompt_token_ids[0])
        entries = [common_pb2.Logprobs(sampled=first), *computed]
        out.prompt_logprobs.extend(self._named(lp) for lp in entries)
        return out

    def add(
        self,
        token_ids: list[int],
        logprobs: list[common_pb2.Logprobs],
        finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED,
        stop_token_id: int | None = None,
    ) -> generation_pb2.GenerateResponse:
        """One worker delta in; the client's delta out (finish fields set when it ends).

        A stop string ends the output at the token that completed it: tokens the worker made
        after it (in the same delta) are neither sent nor counted."""
        seen = len(self.detok.token_ids)
        text = self.detok.add(token_ids)
        if self.detok.matched_stop is not None:
            kept = len(self.detok.token_ids) - seen
            token_ids, logprobs = token_ids[:kept], logprobs[:kept]
        self.completion_tokens += len(token_ids)
        out = generation_pb2.GenerateResponse(
            request_id=self.req.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=[self._named(lp) for lp in logprobs if lp.ByteSize()],
            usage=self.usage(),
        )
        if self.detok.matched_stop is not None:
            self.finished = True
            out.finish_reason = common_pb2.FINISH_REASON_STOP
            out.stop_string = self.detok.matched_stop
        elif finish_reason:
            self.finished = True
            out.finish_reason = finish_reason  # type: ignore[assignment]
            if stop_token_id is not None:
                out.stop_token_id = stop_token_id
        return out

    def _named(self, logprobs: common_pb2.Logprobs) -> common_pb2.Logprobs:
        """`logprobs` with each token's text (`TokenLogprob.token`) filled in."""
        for entry in (logprobs.sampled, *logprobs.top):
            entry.token = self.tokenizer.decode([entry.token_id], skip_special_tokens=False)
        return logprobs

    def finish(
        self, out: generation_pb2.GenerateResponse, reason: int | None = None
    ) -> generation_pb2.GenerateResponse:
        """`out` as the last message: the detokenizer's held-back text, final usage, `reason`."""
        self.finished = True
        out.text += self.detok.flush()
        if reason is not None:
            out.finish_reason = reason  # type: ignore[assignment]
        out.usage.CopyFrom(self.usage())
        return out

    def abort(self) -> generation_pb2.GenerateResponse:
        """The last message of a stream the client cancelled or aborted."""
        return self.finish(self.empty(), common_pb2.FINISH_REASON_ABORT)


def merge(parts: list[generation_pb2.GenerateResponse]) -> generation_pb2.GenerateResponse:
    """Non-streaming requests get one message: the concatenation of the stream."""
    merged = generation_pb2.GenerateResponse()
    for part in parts:
        merged.request_id = part.request_id
        merged.index = part.index
        merged.token_ids.extend(part.token_ids)
        merged.text += part.text
        merged.logprobs.extend(part.logprobs)
        merged.prompt_logprobs.extend(part.prompt_logprobs)
        merged.usage.CopyFrom(part.usage)
        merged.finish_reason = part.finish_reason
        which = part.WhichOneof("matched_stop")
        if which:
            setattr(merged, which, getattr(part, which))
    return merged


@dataclass(slots=True)
class SampleStreams:
    """The client's messages for a request with several samples (`n` / `best_of` > 1).

    Each sample has its own `ClientStream` (detokenizer, stop strings); every message carries
    its sample's `index` and the usage of all samples together. With `best_of > n` nothing is
    sent until every sample has ended: then the n samples with the highest cumulative logprob
    of the tokens they return, as indexes 0 .. n-1, one message each. A beam search's n best
    beams come from the decode worker whole, one message each, when the search has ended.
    """

    req: RouterRequest
    tokenizer: RouterTokenizer
    cached_tokens: int
    streams: list[ClientStream] = field(init=False)
    logprob_sums: list[float] = field(init=False)
    held: list[list[generation_pb2.GenerateResponse]] = field(init=False)
    worker_ended: set[int] = field(default_factory=set)  # samples the decode worker ended

    def stopped_here(self) -> list[int]:
        """Samples a stop string ended here that the decode worker still runs."""
        return [
            i
            for i, stream in enumerate(self.streams)
            if stream.finished and i not in self.worker_ended
        ]

    def __post_init__(self) -> None:
        params = self.req.params
        k = params.n if params.use_beam_search else params.num_samples
        self.streams = [
            ClientStream(self.req, self.tokenizer, self.cached_tokens) for _ in range(k)
        ]
        self.logprob_sums = [0.0] * k
        self.held = [[] for _ in range(k)]

    @property
    def ranked(self) -> bool:
        params = self.req.params
        return not params.use_beam_search and params.num_samples > params.n

    @property
    def finished(self) -> bool:
        return all(stream.finished for stream in self.streams)

    @property
    def completion_tokens(self) -> int:
        return sum(stream.completion_tokens for stream in self.streams)

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(self.req.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_tokens,
        )

    def from_prefill(
        self, prefilled: prefill_pb2.PrefillResponse
    ) -> list[generation_pb2.GenerateResponse]:
        """Every sample's first token (the prefill worker drew them all); nothing for a beam
        search (its beams arrive whole at the end)."""
        if self.req.params.use_beam_search:
            return []
        if len(prefilled.samples) != len(self.streams):
            raise ValueError(
                f"prefill returned {len(prefilled.samples)} samples, expected {len(self.streams)}"
            )
        out = []
        for index, sample in enumerate(prefilled.samples):
            stop = sample.token_id if sample.token_id in self.req.params.stop_token_ids else None
            reason = sample.finish_reason if sample.HasField("finish_reason") else 0
            logprobs = [sample.logprobs] if sample.HasField("logprobs") else []
            stream = self.streams[index]
            msg = stream.add([sample.token_id], logprobs, reason, stop)
            msg = stream.with_prompt_logprobs(msg, prefilled.prompt_logprobs)
            out += self._emit(index, self._finished(index, msg))
        return out

    def _finished(self, index: int, msg: generation_pb2.GenerateResponse):
        stream = self.streams[index]
        return stream.finish(msg) if stream.finished else msg

    def from_decode(self, part: decode_pb2.DecodeResponse) -> list[generation_pb2.GenerateResponse]:
        """One message of the decode worker's stream (one sample's)."""
        if part.index >= len(self.streams) or self.streams[part.index].finished:
            return []  # NOTE: a sample its first token or a stop string already ended
        if part.finish_reason:
            self.worker_ended.add(part.index)
        return self._emit(
            part.index, self._finished(part.index, self.streams[part.index].from_decode(part))
        )

    def abort(self) -> list[generation_pb2.GenerateResponse]:
        """The last messages of a request the client cancelled or aborted: every sample that
        has not ended ends with ABORT (a ranked request returns nothing more)."""
        out = []
        for index, stream in enumerate(self.streams):
            if not stream.finished:
                msg = stream.finish(stream.empty(), common_pb2.FINISH_REASON_ABORT)
                out += [] if self.ranked else self._emit(index, msg)
        return out

    def _emit(
        self, index: int, msg: generation_pb2.GenerateResponse
    ) -> list[generation_pb2.GenerateResponse]:
        self.logprob_sums[index] += sum(lp.sampled.logprob for lp in msg.logprobs)
        if self.req.params.logprobs is None:
            del msg.logprobs[:]  # NOTE: asked of the workers for best_of's ranking only
        msg.index = index
        msg.usage.CopyFrom(self.usage())
        if self.ranked:
            self.held[index].append(msg)
            return self._best() if self.finished else []
        return [msg] if msg.token_ids or msg.text or msg.finish_reason else []

    def _best(self) -> list[generation_pb2.GenerateResponse]:
        """The n best samples by cumulative logprob, as indexes 0 .. n-1, one message each."""
        order = sorted(range(len(self.streams)), key=lambda i: -self.logprob_sums[i])
        out = []
        for rank, index in enumerate(order[: self.req.params.n]):
            msg = merge(self.held[index])
            msg.index = rank
            msg.usage.CopyFrom(self.usage())
            out.append(msg)
        return out


def merge_samples(
    parts: list[generation_pb2.GenerateResponse],
) -> list[generation_pb2.GenerateResponse]:
    """A non-streaming request gets one message per sample (`merge` of its messages), by index."""
    by_index: dict[int, list[generation_pb2.GenerateResponse]] = {}
    for part in parts:
        by_index.setdefault(part.index, []).append(part)
    usage = parts[-1].usage if parts else None
    merged = []
    for index in sorted(by_index):
        msg = merge(by_index[index])
        msg.index = index
        if usage is not None:
            msg.usage.CopyFrom(usage)
        merged.append(msg)
    return merged
