"""Conversions between `pagedserve.v1` messages shared by every service and our dataclasses.

Torch-free (the router imports it). Each service's own messages are converted in that service's
`convert.py`; this module holds only what all of them exchange.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedserve.errors import InvalidArgument
from pagedserve.internal.v1 import worker_pb2
from pagedserve.sampling_params import SamplingParams, StructuredOutput
from pagedserve.v1 import common_pb2
from pagedserve.worker_load import Role, WorkerLoad

# proto field -> dataclass field, for the scalar `optional` fields whose names agree
_SCALARS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "skip_special_tokens",
    "n",
    "best_of",
    "use_beam_search",
    "beam_width",
    "length_penalty",
    "prompt_logprobs",
    "speculative",
)
_FLOATS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"}
_FLOATS |= {"frequency_penalty", "length_penalty"}


def sampling_from_proto(
    msg: common_pb2.SamplingParams, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """Unset fields take `defaults` (the router passes generation_config.json's), then
    SamplingParams' defaults. Not validated: call `.validate()`.

    NOTE: proto floats are float32; they are widened to the nearest decimal of float32 precision
    (0.7 stays 0.7, not 0.699999988) so that every hop sees the same value it was given.
    """
    values: dict[str, object] = dict(defaults or {})
    for name in _SCALARS:
        if msg.HasField(name):
            value = getattr(msg, name)
            values[name] = _float32(value) if name in _FLOATS else value
    values["stop"] = tuple(msg.stop)
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["logit_bias"] = tuple(
        (token_id, _float32(bias)) for token_id, bias in sorted(msg.logit_bias.items())
    )
    values["allowed_token_ids"] = tuple(msg.allowed_token_ids)
    values["bad_words"] = tuple(msg.bad_words)
    values["bad_word_ids"] = tuple(tuple(seq.ids) for seq in msg.bad_word_ids)
    if msg.HasField("structured_output"):
        values["structured_output"] = structured_from_proto(msg.structured_output)
    return SamplingParams(**values)  # type: ignore[arg-type]


def _float32(value: float) -> float:
    return float(f"{value:.7g}")


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    """InvalidArgument when no kind is set."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("structured_output", "set one of json_schema, json, "
                              "regex, choice, grammar")  # fmt: skip
    if kind == "json" and not msg.json:
        raise InvalidArgument("structured_output.json", "must be true when set")
    spec = "" if kind in ("json", "choice") else getattr(msg, kind)
    return StructuredOutput(kind, spec, tuple(msg.choice.choices), msg.resumed_tokens)


def structured_to_proto(grammar: StructuredOutput) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput(resumed_tokens=grammar.resumed_tokens)
    if grammar.kind == "json":
        msg.json = True
    elif grammar.kind == "choice":
        msg.choice.choices.extend(grammar.choices)
    else:
        setattr(msg, grammar.kind, grammar.spec)
    return msg


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every scalar is set explicitly, so the receiver sees exactly these values."""
    msg = common_pb2.SamplingParams(
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=params.allowed_token_ids,
        bad_words=params.bad_words,
        bad_word_ids=[common_pb2.TokenSequence(ids=ids) for ids in params.bad_word_ids],
    )
    for name in _SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return msg


def worker_request_fields(msg: worker_pb2.WorkerRequest) -> dict[str, Any]:
    """The fields both workers take from a `WorkerRequest`, as keyword arguments.

    Only the shape is checked here (`request.request_id` present); values are validated by the
    engine, which names the offending field.
    """
    if not msg.request_id:
        raise InvalidArgument("request.request_id", "must not be empty")
    return {
        "request_id": msg.request_id,
        "prompt_token_ids": list(msg.prompt_token_ids),
        "params": sampling_from_proto(msg.sampling),
        "priority": msg.priority,
        "cache_salt": msg.cache_salt,
    }


_ROLES = {
    Role.ROUTER: common_pb2.WORKER_ROLE_ROUTER,
    Role.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    Role.DECODE: common_pb2.WORKER_ROLE_DECODE,
}
# the `LoadReport` fields that a `WorkerLoad` holds, by the same name
_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerLoad))


def load_to_proto(load: WorkerLoad, worker_id: str, role: Role) -> common_pb2.LoadReport:
    """The `LoadReport` that worker `worker_id` of `role` sends for `load`."""
    values = {name: getattr(load, name) for name in _LOAD_FIELDS}
    return common_pb2.LoadReport(worker_id=worker_id, role=_ROLES[role], **values)


def load_from_proto(msg: common_pb2.LoadReport) -> WorkerLoad:
    """The load in a `LoadReport`, floats as received (`load_to_proto` gives the same message
    back); its `worker_id` and `role` are the caller's to keep."""
    return WorkerLoad(**{name: getattr(msg, name) for name in _LOAD_FIELDS})
