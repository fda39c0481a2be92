"""A small Python client of the public API (what `pagedserve generate --router` and
`pagedserve status` use; any gRPC language can do the same from the protos).

Security matches the router's: `tls_ca` turns TLS on (the CA the router's certificate must chain
to), `tls_client_cert`/`tls_client_key` present a client certificate (mTLS), and `api_key` is sent
as `authorization: Bearer <key>` metadata on every call, `stub` calls included.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from pagedserve.grpcutil import RECONNECT_OPTIONS, client_tls_from_files, make_channel
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)


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
        (`grpcutil.RECONNECT_OPTIONS`: a restarted router is used within a second of its
        return, not after gRPC's default back-off of up to 120 s); `channel_options`, gRPC
        channel arguments, are applied over these."""
        tls = client_tls_from_files(tls_ca, tls_client_cert, tls_client_key, tls_server_name)
        options = dict(RECONNECT_OPTIONS) | dict(channel_options)
        self.channel = make_channel(address, tls, list(options.items()))
        if api_key:
            if tls is None and not is_loopback(address):
                # NOTE: the address only: the key itself never reaches a log
                log.warning(
                    "sending an API key without TLS to %s: anyone on the path can read it "
                    "(use --tls-ca)",
                    address,
                )
            self.channel = grpc.intercept_channel(self.channel, _BearerAuth(api_key))
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


def is_loopback(address: str) -> bool:
    """Whether a gRPC target (`host:port`, `[::1]:port`, `dns:///host:port`, `unix:path`) stays
    on this machine. Unknown names count as remote."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    target = address.split("///", 1)[-1].removeprefix("ipv4:").removeprefix("ipv6:")
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]" in target else target
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every unary and server-streaming call."""

    def __init__(self, api_key: str) -> None:
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def _with_key(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = (*(details.metadata or ()), *self._metadata)
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:  # fmt: skip
        return continuation(self._with_key(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:  # fmt: skip
        return continuation(self._with_key(client_call_details), request)


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
