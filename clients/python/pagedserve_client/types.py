"""Typed results: frozen dataclasses made from the response messages. Each keeps its message as
`raw` (left out of repr and ==) for fields it does not carry, e.g. logprobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve_client.v1 import common_pb2, generation_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
ROLES = {
    common_pb2.WORKER_ROLE_ROUTER: "router",
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
}


def _raw() -> Any:
    return dataclasses.field(default=None, repr=False, compare=False)


def _scalars(cls: type, message: Any) -> dict[str, Any]:
    """The fields of dataclass `cls` that `message` has under the same name (raw excepted)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name != "raw"]
    return {name: getattr(message, name) for name in names if hasattr(message, name)}


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of a request so far (cumulative)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class GenerateChunk:
    """What is new in one streamed response. `finish_reason` ("stop", "length", "abort",
    "error") is None on every chunk but the last of its sample; `stop` is the matched stop
    string or stop token id (None when EOS stopped it, or before the end)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    usage: Usage
    index: int = 0
    stop: str | int | None = None
    raw: generation_pb2.GenerateResponse = _raw()

    @classmethod
    def from_proto(cls, message: generation_pb2.GenerateResponse) -> GenerateChunk:
        which = message.WhichOneof("matched_stop")
        return cls(
            request_id=message.request_id,
            token_ids=tuple(message.token_ids),
            text=message.text,
            finish_reason=FINISH_REASONS.get(message.finish_reason),
            usage=Usage(**_scalars(Usage, message.usage)),
            index=message.index,
            stop=getattr(message, which) if which else None,
            raw=message,
        )


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The served model and its limits (generation.proto, ModelInfo)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    architecture: str
    max_logprobs: int
    has_chat_template: bool
    tool_call_parser: str
    raw: generation_pb2.ModelInfo = _raw()

    @classmethod
    def from_proto(cls, message: generation_pb2.ModelInfo) -> ModelInfo:
        fields = _scalars(cls, message) | {"eos_token_ids": tuple(message.eos_token_ids)}
        return cls(**fields, raw=message)


@dataclasses.dataclass(frozen=True)
class WorkerLoad:
    """A worker's latest load report (common.proto, LoadReport)."""

    num_requests_running: int
    num_requests_waiting: int
    num_requests_swapped: int
    queued_prefill_tokens: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    draining: bool
    reported_at_unix_ms: int
    accepts_prefill_here: bool
    tensor_parallel_size: int


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    """One worker as the router sees it; `role` is "router", "prefill" or "decode"; `load` is
    None until the router has a report."""

    worker_id: str
    role: str
    address: str
    incarnation: str
    alive: bool
    restarts: int
    load: WorkerLoad | None

    @classmethod
    def from_proto(cls, message: generation_pb2.WorkerStatus) -> WorkerStatus:
        load = WorkerLoad(**_scalars(WorkerLoad, message.load))
        fields = _scalars(cls, message) | {
            "role": ROLES.get(message.role, "unspecified"),
            "load": load if message.HasField("load") else None,
        }
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class ClusterStatus:
    """The cluster as one router sees it: its workers sorted by id."""

    workers: tuple[WorkerStatus, ...]
    prefix_cache_hit_rate: float
    index_degraded: bool
    raw: generation_pb2.ClusterStatus = _raw()

    @classmethod
    def from_proto(cls, message: generation_pb2.ClusterStatus) -> ClusterStatus:
        return cls(
            workers=tuple(WorkerStatus.from_proto(w) for w in message.workers),
            prefix_cache_hit_rate=message.prefix_cache_hit_rate,
            index_degraded=message.index_degraded,
            raw=message,
        )
