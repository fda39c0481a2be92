"""The client's stream: the prefill worker's first token and the decode worker's stream, merged
into `GenerateResponse`s.

    PrefillResponse ─► from_prefill ─┐
                                     ├─► token delta + text delta + cumulative usage (+ finish)
    DecodeResponse* ─► from_decode ──┘

Stop strings are matched here (the router detokenizes); stop tokens, eos and length come
finished from the workers. A non-streaming request gets one message, `merge` of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.router.convert import RouterRequest
from pagedserve.router.detokenizer import Detokenizer
from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.v1 import common_pb2, decode_pb2, generation_pb2, prefill_pb2


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
        return self.add([token], [prefilled.logprobs], prefilled.finish_reason, stop_token)

    def from_decode(self, part: decode_pb2.DecodeResponse) -> generation_pb2.GenerateResponse:
        """One message of the decode worker's stream."""
        stop_token = part.matched_stop_token_id if part.HasField("matched_stop_token_id") else None
        return self.add(list(part.token_ids), list(part.logprobs), part.finish_reason, stop_token)

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
        merged.token_ids.extend(part.token_ids)
        merged.text += part.text
        merged.logprobs.extend(part.logprobs)
        merged.usage.CopyFrom(part.usage)
        merged.finish_reason = part.finish_reason
        which = part.WhichOneof("matched_stop")
        if which:
            setattr(merged, which, getattr(part, which))
    return merged
