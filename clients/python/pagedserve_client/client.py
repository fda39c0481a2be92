"""The synchronous client."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

from pagedserve_client import retry as _retry
from pagedserve_client._channel import ChannelSettings, open_channel
from pagedserve_client.requests import chat_request, generate_request
from pagedserve_client.types import ClusterStatus, GenerateChunk, ModelInfo
from pagedserve_client.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class Client:
    """A router's Generation service over one channel. Keyword arguments are ChannelSettings'
    (TLS paths, api_key, retry, channel_options); TLS file errors surface here (ValueError,
    OSError). `stub` is the raw generated stub on the same channel (key and retries apply)."""

    def __init__(self, address: str, **settings: Any) -> None:
        self.settings = ChannelSettings(**settings)
        self.channel: grpc.Channel = open_channel(address, self.settings)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        stream_interval: int = 0,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[GenerateChunk]:
        """Stream the completion of a text or of token ids, chunk by chunk. `sampling`: fields
        of SamplingParams (`max_tokens=8, temperature=0.0, stop=["\\n"]`; unset: the server's
        default). Closing the iterator early (break, `close()`) cancels the request. gRPC errors
        raise grpc.RpcError once the retries (RetryPolicy) are spent."""
        options = {
            "request_id": request_id,
            "priority": priority,
            "cache_salt": cache_salt,
            "stream_interval": stream_interval,
            "add_special_tokens": add_special_tokens,
        }
        return self._stream(generate_request(prompt, options, sampling), timeout)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        stream_interval: int = 0,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[GenerateChunk]:
        """Stream the answer to a conversation (`{"role": ..., "content": ...}` mappings, oldest
        first), rendered by the router with the model's chat template; as `generate`."""
        options = {
            "request_id": request_id,
            "priority": priority,
            "cache_salt": cache_salt,
            "stream_interval": stream_interval,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._stream(chat_request(messages, options, sampling), timeout)

    def status(self, timeout: float = 5.0) -> ClusterStatus:
        request = generation_pb2.GetClusterStatusRequest()
        return ClusterStatus.from_proto(self._unary(self.stub.GetClusterStatus, request, timeout))

    def model_info(self, timeout: float = 5.0) -> ModelInfo:
        request = generation_pb2.GetModelInfoRequest()
        return ModelInfo.from_proto(self._unary(self.stub.GetModelInfo, request, timeout))

    def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        """Ends a request of this caller by id; whether it was still in flight."""
        request = common_pb2.AbortRequest(request_id=request_id)
        return bool(self._unary(self.stub.Abort, request, timeout).found)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = _retry.deadline_of(timeout)
        attempt = 1
        while True:
            try:
                return method(request, timeout=_retry.remaining(deadline))
            except grpc.RpcError as error:
                wait = _retry.overload_wait(self.settings.retry, error, attempt, deadline)
                if wait is None:
                    raise
            time.sleep(wait)
            attempt += 1

    def _stream(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> Iterator[GenerateChunk]:
        deadline = _retry.deadline_of(timeout)
        attempt = 1
        while True:
            call = self.stub.Generate(request, timeout=_retry.remaining(deadline))
            started = False
            try:
                for response in call:
                    started = True
                    yield GenerateChunk.from_proto(response)
                return
            except grpc.RpcError as error:
                # NOTE: once a chunk reached the caller, trying again would repeat it
                policy = None if started else self.settings.retry
                wait = _retry.overload_wait(policy, error, attempt, deadline)
                if wait is None:
                    raise
            finally:
                call.cancel()  # NOTE: no-op after the end; closed early: cancels now, not at GC
            time.sleep(wait)
            attempt += 1
