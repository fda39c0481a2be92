"""The Python client of the public API that pagedserve's own CLI, benches and tests use
(`pagedserve generate --router`, `pagedserve status`): pagedserve's SamplingParams in, the raw
response messages out, no retries. It is built on the `pagedserve-client`
distribution (clients/python/, import `pagedserve_client`: the channel, TLS, the API key,
retries); applications use that one directly (typed results, asyncio, retries on by default,
no torch).

Security matches the router's: `tls_ca` turns TLS on (the CA the router's certificate must chain
to), `tls_client_cert`/`tls_client_key` present a client certificate (mTLS), and `api_key` is sent
as `authorization: Bearer <key>` metadata on every call, `stub` calls included.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from pagedserve_client import ChannelSettings, is_loopback, open_channel

__all__ = ["Client", "format_status", "is_loopback"]


class Client:
    def __init__(
        self,
        address: str,
        *,
        tls_ca: str | None = None,
        tls_client_cert: str | None = None,
        tls_client_key: str | None = None,
        tls_server_name: str | None = None,
        api_key: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """TLS arguments are PEM paths (ValueError when only one of cert and key is given,
        OSError when one cannot be read). The key is kept only inside the channel's metadata.

        The channel tries a router that went away again at least once a second
        (`pagedserve_client.RECONNECT_OPTIONS`: a restarted router is used within a second of
        its return, not after gRPC's default back-off of up to 120 s); `channel_options`, gRPC
        channel arguments, are applied over these. No retries: a failed call raises at once
        (pagedserve_client.Client retries)."""
        settings = ChannelSettings(
            tls_ca=tls_ca, tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
            tls_server_name=tls_server_name, api_key=api_key, retry=None,
            channel_options=channel_options,
        )  # fmt: skip
        self.channel = open_channel(address, settings)
        # NOTE: pagedserve.v1's stub: responses are the messages the rest of pagedserve uses
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        timeout: float | None = None,
        stream_interval: int = 0,
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """Stream the response messages (the iterator's `cancel()` aborts the request).
        `stream_interval`: the least tokens per message after the first (0: the router's)."""
        request = _request(params, request_id, priority, cache_salt)
        request.stream_interval = stream_interval
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return self.stub.Generate(request, timeout=timeout)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        params: SamplingParams,
        *,
        add_generation_prompt: bool = True,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """Stream the answer to a conversation: `messages` are `{"role": ..., "content": ...}`,
        oldest first; the router renders them with the model's chat template."""
        request = _request(params, request_id, priority, cache_salt)
        request.messages.SetInParent()  # NOTE: selects the oneof even for an empty list
        for message in messages:
            request.messages.messages.add(role=message["role"], content=message["content"])
        request.add_generation_prompt = add_generation_prompt
        return self.stub.Generate(request, timeout=timeout)

    def status(self, timeout: float = 5.0) -> generation_pb2.ClusterStatus:
        return self.stub.GetClusterStatus(generation_pb2.GetClusterStatusRequest(), timeout=timeout)

    def model_info(self, timeout: float = 5.0) -> generation_pb2.ModelInfo:
        return self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)

    def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        request = common_pb2.AbortRequest(request_id=request_id)
        return self.stub.Abort(request, timeout=timeout).found


def _request(
    params: SamplingParams, request_id: str, priority: int, cache_salt: str
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        sampling=sampling_to_proto(params),
        priority=priority,
        cache_salt=cache_salt,
        stream=True,
    )


def format_status(status: generation_pb2.ClusterStatus) -> str:
    lines = [
        f"prefix cache hit rate {status.prefix_cache_hit_rate:.2f}"
        + ("   (index degraded: routing by load only)" if status.index_degraded else ""),
        f"{'worker':<24} {'role':<8} {'alive':<6} {'run':>4} {'wait':>5} {'kv used':>8} "
        f"{'free':>6} {'cached':>7} {'restarts':>8}",
    ]
    for w in status.workers:
        role = common_pb2.WorkerRole.Name(w.role).removeprefix("WORKER_ROLE_").lower()
        load = w.load
        lines.append(
            f"{w.worker_id:<24} {role:<8} {str(w.alive).lower():<6} "
            f"{load.num_requests_running:>4} {load.num_requests_waiting:>5} "
            f"{load.kv_cache_usage:>8.1%} {load.kv_blocks_free:>6} {load.kv_blocks_cached:>7} "
            f"{w.restarts:>8}"
        )
    return "\n".join(lines)
