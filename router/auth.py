"""API keys on the public API: who is calling, decided before any tokenization.

Keys come from `--api-key-file` (one `tenant:key` a line, `#` comments) or the environment
variable `PAGEDSERVE_API_KEYS` (the same pairs, separated by commas or newlines), read once at
start-up. Clients send `authorization: Bearer <key>`. `AuthInterceptor` rejects a missing or
unknown key with UNAUTHENTICATED and otherwise runs the method with `current_tenant()` set to the
key's tenant, which the servicer uses to scope request ids (and so Abort) to the tenant's own
requests and to prefix `cache_salt` (so two tenants never share prefix-cache blocks). Health
checks need no key (probes).

NOTE: keys are compared with `hmac.compare_digest` against every configured key, without an early
exit, so the time taken says nothing about which key (or how much of one) matched. Keys never
appear in logs, reprs or error messages.
"""

from __future__ import annotations

import contextvars
import hmac
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ENV_VAR = "PAGEDSERVE_API_KEYS"
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

_current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="")


def current_tenant() -> str:
    """The authenticated tenant of the RPC this task serves ("" when auth is off)."""
    return _current_tenant.get()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Tenant of each key. Build with `parse`; `tenant_for` is constant-time over the keys."""

    _entries: tuple[tuple[bytes, str], ...] = field(repr=False)

    @classmethod
    def parse(cls, text: str, source: str) -> ApiKeys:
        """`tenant:key` pairs, one per line or comma; ValueError names `source` and the line
        (never the key)."""
        entries: list[tuple[bytes, str]] = []
        for number, raw in enumerate(re.split(r"[\n,]", text), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, key = line.partition(":")
            tenant, key = tenant.strip(), key.strip()
            if not sep or not _TENANT.fullmatch(tenant) or len(key) < 16:
                raise ValueError(
                    f"{source}: entry {number} must be tenant:key (tenant [A-Za-z0-9_.-], "
                    "key of at least 16 characters)"
                )
            entries.append((key.encode(), tenant))
        if not entries:
            raise ValueError(f"{source}: no tenant:key entries")
        return cls(tuple(entries))

    def tenant_for(self, key: str) -> str | None:
        candidate = key.encode()
        found = None
        for secret, tenant in self._entries:
            if hmac.compare_digest(candidate, secret):
                found = tenant
        return found

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._entries}


def load_api_keys(path: str | None, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """Keys from `path` (wins) or `$PAGEDSERVE_API_KEYS`; None when neither is set (no auth)."""
    if path:
        return ApiKeys.parse(Path(path).read_text(), f"--api-key-file {path}")
    if environ.get(ENV_VAR, "").strip():
        return ApiKeys.parse(environ[ENV_VAR], ENV_VAR)
    return None


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a known key; else the method runs with its tenant set (each RPC
    is its own asyncio task, so the context variable is the RPC's own)."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:  # server reflection
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return None  # NOTE: fail closed for a method shape this interceptor does not know

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Set the tenant for this RPC, or abort UNAUTHENTICATED."""
        key = _bearer(context.invocation_metadata())
        tenant = self._keys.tenant_for(key) if key else None
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        _current_tenant.set(tenant or "")

    def _unary(self, fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._authenticate(context)
            return await fn(request, context)

        return call

    def _stream(self, fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await self._authenticate(context)
            async for response in fn(request, context):
                yield response

        return call


def worker_request_id(tenant: str, request_id: str) -> str:
    """The id workers see (their logs, spans, in-flight tables) for a tenant's request: unique
    across tenants, the client's own id when auth is off. Never sent back to a client.

    NOTE: tenants match [A-Za-z0-9_.-], so `tenant:id` cannot collide with another tenant's id.
    """
    return f"{tenant}:{request_id}" if tenant else request_id


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The salt the block hashes use: the tenant's own namespace of the prefix cache.

    NOTE: tenants match [A-Za-z0-9_.-], so `tenant:` cannot be forged by another tenant's salt.
    """
    return f"{tenant}:{cache_salt}" if tenant else cache_salt
