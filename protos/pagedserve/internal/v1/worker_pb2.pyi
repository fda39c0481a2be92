from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleStart(_message.Message):
    __slots__ = ("token_id", "logprobs", "finish_reason")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: _common_pb2.Logprobs
    finish_reason: _common_pb2.FinishReason
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "compat_hash", "scale_layout", "tensor_parallel_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    SCALE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    compat_hash: bytes
    scale_layout: str
    tensor_parallel_size: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., compat_hash: _Optional[bytes] = ..., scale_layout: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class ShmTransport(_message.Message):
    __slots__ = ("segment_name", "host_id", "pool_offset_bytes", "num_blocks", "block_stride_bytes", "layer_stride_bytes", "kv_stride_bytes")
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    segment_name: str
    host_id: str
    pool_offset_bytes: int
    num_blocks: int
    block_stride_bytes: int
    layer_stride_bytes: int
    kv_stride_bytes: int
    def __init__(self, segment_name: _Optional[str] = ..., host_id: _Optional[str] = ..., pool_offset_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., layer_stride_bytes: _Optional[int] = ..., kv_stride_bytes: _Optional[int] = ...) -> None: ...

class GrpcTransport(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("version", "handle_id", "producer_id", "producer_incarnation", "producer_address", "request_id", "num_tokens", "block_size", "block_ids", "block_hashes", "layout", "lease_expires_unix_ms", "shm", "grpc", "trace_context", "shards")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    handle_id: str
    producer_id: str
    producer_incarnation: str
    producer_address: str
    request_id: str
    num_tokens: int
    block_size: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: KvLayout
    lease_expires_unix_ms: int
    shm: ShmTransport
    grpc: GrpcTransport
    trace_context: _containers.ScalarMap[str, str]
    shards: _containers.RepeatedCompositeFieldContainer[KvShard]
    def __init__(self, version: _Optional[int] = ..., handle_id: _Optional[str] = ..., producer_id: _Optional[str] = ..., producer_incarnation: _Optional[str] = ..., producer_address: _Optional[str] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., lease_expires_unix_ms: _Optional[int] = ..., shm: _Optional[_Union[ShmTransport, _Mapping]] = ..., grpc: _Optional[_Union[GrpcTransport, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., shards: _Optional[_Iterable[_Union[KvShard, _Mapping]]] = ...) -> None: ...

class KvShard(_message.Message):
    __slots__ = ("rank", "shm")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    shm: ShmTransport
    def __init__(self, rank: _Optional[int] = ..., shm: _Optional[_Union[ShmTransport, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., stream_interval: _Optional[int] = ...) -> None: ...
