from pagedserve.internal.v1 import worker_pb2 as _worker_pb2
from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request", "first_token", "first_logprobs", "kv_handle", "samples", "prefill_here", "delivery_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    request: _worker_pb2.WorkerRequest
    first_token: int
    first_logprobs: _common_pb2.Logprobs
    kv_handle: _worker_pb2.KvHandle
    samples: _containers.RepeatedCompositeFieldContainer[_worker_pb2.SampleStart]
    prefill_here: bool
    delivery_id: str
    def __init__(self, request: _Optional[_Union[_worker_pb2.WorkerRequest, _Mapping]] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., kv_handle: _Optional[_Union[_worker_pb2.KvHandle, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[_worker_pb2.SampleStart, _Mapping]]] = ..., prefill_here: _Optional[bool] = ..., delivery_id: _Optional[str] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("delivery_id",)
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    delivery_id: str
    def __init__(self, delivery_id: _Optional[str] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[DecodeResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[DecodeResponse, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "num_generated", "finish_reason", "matched_stop_token_id", "num_preemptions", "recomputed_prompt", "index", "cached_prompt_tokens", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_PROMPT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    num_generated: int
    finish_reason: _common_pb2.FinishReason
    matched_stop_token_id: int
    num_preemptions: int
    recomputed_prompt: bool
    index: int
    cached_prompt_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., num_generated: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., matched_stop_token_id: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., recomputed_prompt: _Optional[bool] = ..., index: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...
