"""`pagedserve.v1` messages for the model's own types (logprobs, finish reasons).

Shared by both workers' `convert.py`; nothing else in `model/` touches protobuf.
"""

from __future__ import annotations

from pagedserve.model.requests.batch import TokenLogprobs
from pagedserve.model.requests.sequence import FinishReason, Sequence
from pagedserve.v1 import common_pb2

FINISH_REASONS: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else FINISH_REASONS[reason]


def logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(
        sampled=common_pb2.TokenLogprob(
            token_id=logprobs.token_id, logprob=logprobs.logprob, rank=logprobs.rank
        ),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def logprobs_from_proto(msg: common_pb2.Logprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.sampled.token_id,
        logprob=msg.sampled.logprob,
        rank=msg.sampled.rank,
        top=[(t.token_id, t.logprob) for t in msg.top],
    )


def prompt_logprobs_to_proto(seq: Sequence) -> list[common_pb2.Logprobs]:
    """`seq`'s prompt logprobs as the workers send them: prompt tokens 1 .. len - 1, in order
    (the first token has none); empty when the request asked for none."""
    if seq.params.prompt_logprobs is None or seq.sample_index != 0:
        return []
    return [logprobs_to_proto(lp) for lp in seq.prompt_logprobs]
