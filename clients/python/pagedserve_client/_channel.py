"""The channel to a router: TLS, the API key as bearer metadata, reconnects and retries."""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from pagedserve_client.retry import RetryPolicy, service_config

log = logging.getLogger("pagedserve_client")

# NOTE: a restarted router comes back at the same address within seconds, but gRPC's reconnect
# back-off grows to 120 s by default, and a call fails at once (UNAVAILABLE) while its channel
# waits out the back-off, even with the router up again.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Default channel options: at most a second between reconnects to a router that went away."""


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


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    """PEM paths -> TLS channel credentials, None (plaintext) without a CA or a certificate.
    ValueError when only one of cert and key is given; OSError when a file cannot be read."""
    if bool(cert) != bool(key):
        raise ValueError("tls_client_cert and tls_client_key (--tls-client-cert and "
                         "--tls-client-key): give both or neither")  # fmt: skip
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert))


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class BearerAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
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


class AsyncBearerAuth(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """BearerAuth for grpc.aio channels."""

    def __init__(self, api_key: str) -> None:
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def _with_key(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )  # fmt: skip

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:  # fmt: skip
        return await continuation(self._with_key(client_call_details), request)

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:  # fmt: skip
        return await continuation(self._with_key(client_call_details), request)


def channel_options(
    retry: RetryPolicy | None, tls_server_name: str | None, extra: Sequence[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """RECONNECT_OPTIONS, the retry service config and the TLS name override, then `extra`
    (gRPC channel arguments) over them."""
    options: dict[str, Any] = dict(RECONNECT_OPTIONS)
    if retry is not None:
        options["grpc.service_config"] = service_config(retry)
    if tls_server_name:
        options["grpc.ssl_target_name_override"] = tls_server_name
    return list((options | dict(extra)).items())


def warn_plaintext_key(address: str, tls: bool, api_key: str | None) -> None:
    if api_key and not tls and not is_loopback(address):
        # NOTE: the address only: the key itself never reaches a log
        log.warning(
            "sending an API key without TLS to %s: anyone on the path can read it (use --tls-ca)",
            address,
        )


def open_channel(address: str, settings: ChannelSettings, *, aio: bool = False) -> Any:
    """A channel to a router (`grpc.aio` with `aio`: create it on the loop that will use it)."""
    creds = credentials(settings.tls_ca, settings.tls_client_cert, settings.tls_client_key)
    warn_plaintext_key(address, creds is not None, settings.api_key)
    options = channel_options(settings.retry, settings.tls_server_name, settings.channel_options)
    if aio:
        interceptors = [AsyncBearerAuth(settings.api_key)] if settings.api_key else None
        if creds is None:
            return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)
    channel = (
        grpc.insecure_channel(address, options)
        if creds is None
        else grpc.secure_channel(address, creds, options)
    )
    if settings.api_key:
        channel = grpc.intercept_channel(channel, BearerAuth(settings.api_key))
    return channel


@dataclasses.dataclass(frozen=True)
class ChannelSettings:
    """How to reach a router. TLS fields are PEM paths: `tls_ca` turns TLS on (the CA the
    router's certificate must chain to), `tls_client_cert`/`tls_client_key` present a client
    certificate (mTLS), `tls_server_name` overrides the name checked against the router's
    certificate. `api_key` goes as `authorization: Bearer <key>` metadata on every call (raw
    `stub` calls included). `retry`: see RetryPolicy (None: no retries). `channel_options`:
    gRPC channel arguments, applied last."""

    tls_ca: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = dataclasses.field(default=None, repr=False)
    tls_server_name: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
    retry: RetryPolicy | None = RetryPolicy()
    channel_options: Sequence[tuple[str, Any]] = ()
