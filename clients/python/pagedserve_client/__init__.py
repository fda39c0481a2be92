"""pagedserve-client: a Python client of a pagedserve router's public gRPC API
(pagedserve.v1.Generation), sync (`Client`) and asyncio (`AsyncClient`), with retries
(`RetryPolicy`) and typed results. Needs grpcio and protobuf only.

    from pagedserve_client import Client

    with Client("127.0.0.1:50051") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text, end="")

The raw generated code is `pagedserve_client.v1` (common_pb2, generation_pb2,
generation_pb2_grpc); `client.stub` is the generated stub on the client's channel.
"""

from pagedserve_client._channel import RECONNECT_OPTIONS, ChannelSettings, is_loopback, open_channel
from pagedserve_client.aio import AsyncClient
from pagedserve_client.client import Client
from pagedserve_client.retry import RetryPolicy, retry_delay
from pagedserve_client.types import (
    ClusterStatus,
    GenerateChunk,
    ModelInfo,
    Usage,
    WorkerLoad,
    WorkerStatus,
)

__all__ = [
    "RECONNECT_OPTIONS",
    "AsyncClient",
    "ChannelSettings",
    "Client",
    "ClusterStatus",
    "GenerateChunk",
    "ModelInfo",
    "RetryPolicy",
    "Usage",
    "WorkerLoad",
    "WorkerStatus",
    "is_loopback",
    "open_channel",
    "retry_delay",
]
