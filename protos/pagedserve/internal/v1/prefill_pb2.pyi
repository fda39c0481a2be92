from pagedserve.internal.v1 import worker_pb2 as _worker_pb2
from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request", "lease_seconds", "decode_worker_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request: _worker_pb2.WorkerRequest
    lease_seconds: int
    decode_worker_id: str
    def __init__(self, request: _Optional[_Union[_worker_pb2.WorkerRequest, _Mapping]] = ..., lease_seconds: _Optional[int] = ..., decode_worker_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "logprobs", "kv_handle", "cached_tokens", "computed_tokens", "finish_reason", "samples", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    logprobs: _common_pb2.Logprobs
    kv_handle: _worker_pb2.KvHandle
    cached_tokens: int
    computed_tokens: int
    finish_reason: _common_pb2.FinishReason
    samples: _containers.RepeatedCompositeFieldContainer[_worker_pb2.SampleStart]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., kv_handle: _Optional[_Union[_worker_pb2.KvHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., samples: _Optional[_Iterable[_Union[_worker_pb2.SampleStart, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("handle_id", "producer_incarnation", "block_indices", "max_chunk_bytes", "rank")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    producer_incarnation: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    max_chunk_bytes: int
    rank: int
    def __init__(self, handle_id: _Optional[str] = ..., producer_incarnation: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ..., max_chunk_bytes: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("block_index", "block_id", "data", "offset", "last_of_block")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OF_BLOCK_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    block_id: int
    data: bytes
    offset: int
    last_of_block: bool
    def __init__(self, block_index: _Optional[int] = ..., block_id: _Optional[int] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., last_of_block: _Optional[bool] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("handle_id",)
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    def __init__(self, handle_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("handle_id", "extend_seconds")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    extend_seconds: int
    def __init__(self, handle_id: _Optional[str] = ..., extend_seconds: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_expires_unix_ms",)
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix_ms: int
    def __init__(self, lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("prompts", "cache_salt")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenIds]
    cache_salt: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[_common_pb2.TokenIds, _Mapping]]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("blocks_cached",)
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    blocks_cached: int
    def __init__(self, blocks_cached: _Optional[int] = ...) -> None: ...
