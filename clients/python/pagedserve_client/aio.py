"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from pagedserve_client import retry as _retry
from pagedserve_client._channel import ChannelSettings, open_channel
from pagedserve_client.requests import chat_request, generate_request
from pagedserve_client.types import ClusterStatus, GenerateChunk, ModelInfo
from pagedserve_client.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class AsyncClient:
    """Client's methods as coroutines and async iterators, over a grpc.aio channel: create it
    inside the event loop that uses it. Same keyword arguments as Client."""

    def __init__(self, address: str, **settings: Any) -> None:
        self.settings = ChannelSettings(**settings)
        self.channel: grpc.aio.Channel = open_channel(address, self.settings, aio=True)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

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
    ) -> AsyncIterator[GenerateChunk]:
        """As Client.generate; `async for chunk in client.generate(...)`. Closing the iterator
        early (`aclose()`, leaving an `async with contextlib.aclosing(...)`) cancels."""
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
    ) -> AsyncIterator[GenerateChunk]:
        """As Client.chat."""
        options = {
            "request_id": request_id,
            "priority": priority,
            "cache_salt": cache_salt,
            "stream_interval": stream_interval,
            "add_generation_prompt": add_generation_prompt,
        }
        return self._stream(chat_request(messages, options, sampling), timeout)

    async def status(self, timeout: float = 5.0) -> ClusterStatus:
        request = generation_pb2.GetClusterStatusRequest()
        message = await self._unary(self.stub.GetClusterStatus, request, timeout)
        return ClusterStatus.from_proto(message)

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        request = generation_pb2.GetModelInfoRequest()
        return ModelInfo.from_proto(await self._unary(self.stub.GetModelInfo, request, timeout))

    async def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        request = common_pb2.AbortRequest(request_id=request_id)
        return bool((await self._unary(self.stub.Abort, request, timeout)).found)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = _retry.deadline_of(timeout)
        attempt = 1
        while True:
            try:
                return await method(request, timeout=_retry.remaining(deadline))
            except grpc.RpcError as error:
                wait = _retry.overload_wait(self.settings.retry, error, attempt, deadline)
                if wait is None:
                    raise
            await asyncio.sleep(wait)
            attempt += 1

    async def _stream(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[GenerateChunk]:
        deadline = _retry.deadline_of(timeout)
        attempt = 1
        while True:
            call = self.stub.Generate(request, timeout=_retry.remaining(deadline))
            started = False
            try:
                async for response in call:
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
                call.cancel()  # NOTE: no-op after the end; cancels at the router when closed early
            await asyncio.sleep(wait)
            attempt += 1
