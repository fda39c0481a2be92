"""gRPC server plumbing shared by every pagedserve service (router, prefill, decode).

`build_server` gives each server the same shape, an asyncio `grpc.aio` server (docs/architecture.md)
with explicit message size limits (never unlimited), `grpc.health.v1.Health` (service `""` =
alive, the service's full name = ready), server reflection, and `ErrorInterceptor`, the one
place where exceptions become status codes (`pagedserve/errors.py` has the table). Servicers
stay thin: they raise, the interceptor maps.

Transport security is one pair of types: `ServerTLS` (`--tls-cert/--tls-key`, plus
`--tls-client-ca` to require client certificates, i.e. mTLS) and `ClientTLS` (`--tls-ca`,
`--tls-client-cert/--tls-client-key`) for every outgoing channel, built by `make_channel`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from pagedserve.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# NOTE: gRPC core drops calls that arrived but that the server has not yet picked up beyond
# `grpc.server.max_pending_requests` (1000: dropped at random above it, all above the hard limit,
# 3000) with a bare CANCELLED: no RetryInfo, and a router reads a cancelled Prefill as its
# client leaving. Measured on 2 cores, a grpc.aio server with a 3 s handler: 2,000 calls at once
# lose 220, 3,000 lose ~700. A burst must reach our own admission control (docs/router.md), so
# the limit is far above any queue we keep: a pending call costs gRPC its request bytes only.
DEFAULT_MAX_PENDING_CALLS = 16384
T = TypeVar("T")


def _status(code: int, message: str, *details: Any) -> status_pb2.Status:
    status = status_pb2.Status(code=code, message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return status


def status_for(exc: BaseException) -> status_pb2.Status:
    """The `google.rpc.Status` an exception maps to (docs/architecture.md)."""
    if isinstance(exc, InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=exc.description
        )
        bad_request = error_details_pb2.BadRequest(field_violations=[violation])
        return _status(code_pb2.INVALID_ARGUMENT, str(exc), bad_request)
    if isinstance(exc, ValueError):
        return _status(code_pb2.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, ResourceExhausted):
        details = []
        if exc.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(exc), *details)
    if isinstance(exc, Unavailable):
        return _status(code_pb2.UNAVAILABLE, str(exc) or "unavailable")
    if isinstance(exc, AlreadyExists):
        return _status(code_pb2.ALREADY_EXISTS, str(exc))
    return _status(code_pb2.INTERNAL, f"internal error: {type(exc).__name__}")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    status = status_for(exc)
    if status.code == code_pb2.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    await context.abort_with_status(rpc_status.to_status(status))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a servicer method to status codes, for unary and streaming
    responses alike. An `abort()` the servicer made itself passes through untouched."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler  # client-streaming methods: none in pagedserve.v1


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """A request whose bytes do not parse (grpcio would answer INTERNAL; it is the caller's)."""

    error: str


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # NOTE: DecodeError, and whatever else a parser may raise
            return _Undecodable(type(exc).__name__)

    return parse


async def _reject_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort_with_status(
            rpc_status.to_status(
                _status(code_pb2.INVALID_ARGUMENT, f"request does not parse ({request.error})")
            )
        )


def _wrap_unary(fn: Callable[[Any, Any], Awaitable[Any]], method: str) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _reject_undecodable(request, context)
        try:
            return await fn(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError) or context.code() is not None:
                raise  # the servicer already aborted
            await _abort(context, method, exc)

    return call


def _wrap_stream(fn: Callable[[Any, Any], Any], method: str) -> Callable:
    if not inspect.isasyncgenfunction(fn):
        # NOTE: a coroutine that writes with `context.write` (grpc_health's aio Watch): grpc
        # serves the two shapes differently, so the wrapper keeps the handler's
        return _wrap_unary(fn, method)

    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _reject_undecodable(request, context)
        try:
            async for response in fn(request, context):
                yield response
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError) or context.code() is not None:
                raise
            await _abort(context, method, exc)

    return call


@dataclass(slots=True)
class ServerHandle:
    """A started-or-not server with its health servicer, the port it bound and its loop."""

    server: grpc.aio.Server
    health: aio_health.HealthServicer
    port: int
    service_names: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    # NOTE: `health_address`'s plaintext server: the same HealthServicer, nothing else
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    async def add_health_port(self, address: str | None) -> None:
        """`--health-port`: a second server at `address` (None: none), plaintext, with only this
        server's `grpc.health.v1.Health` (the same statuses; no reflection, no other service),
        for probes that cannot speak TLS (kubelet's). On the server's loop, before `start()`, which
        starts both.
        RuntimeError if `address` cannot be bound."""
        if address is None:
            return
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4096)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.health_port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind the health port {address}: {exc}") from exc
        self.health_server = server

    async def start(self) -> None:
        """Start the server and, with a health port, its health-only server."""
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def stop(self, grace: float | None) -> None:
        """Stop both; the health server last, so probes see NOT_SERVING while streams drain."""
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)

    async def set_ready(self, ready: bool) -> None:
        """Readiness of every service this server hosts; `""` (liveness) stays SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.service_names:
            await self.health.set(name, status)

    def set_ready_threadsafe(self, ready: bool) -> None:
        """`set_ready` from any thread (an engine loop that dies); does not wait for it."""
        asyncio.run_coroutine_threadsafe(self.set_ready(ready), self.loop)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection(server: grpc.aio.Server, listed: Sequence[str]) -> None:
    """Server reflection v1alpha (grpcio-reflection's servicer) and v1: the same servicer under
    v1's name. NOTE: grpcio-reflection ships only v1alpha; v1 is v1alpha renamed, the same
    messages field for field, so the bytes on the wire are the same (grpcurl asks v1 first)."""
    servicer = reflection.aio.ReflectionServicer(listed)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


async def build_server(
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    *,
    address: str = "127.0.0.1:0",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
    max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS,
) -> ServerHandle:
    """Create (not start) an asyncio server with health, reflection and `ErrorInterceptor`, on
    the running event loop (docs/architecture.md: no thread per stream or request).

    `register` are callables like `lambda s: add_FooServicer_to_server(servicer, s)` with
    `async` servicer methods; `service_names` are their full names (`pagedserve.v1.Generation`).
    The services start NOT_SERVING for readiness: `await set_ready(True)` once the model is
    loaded. With `tls` the port speaks only TLS (mTLS when `tls.client_ca` is set).
    `max_pending_calls`: calls gRPC core holds before the server picks them up (beyond it,
    CANCELLED). Raises RuntimeError if `address` cannot be bound.
    """
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes: must be positive, got {max_message_bytes}")
    if max_pending_calls <= 0:
        raise ValueError(f"max_pending_calls: must be positive, got {max_pending_calls}")
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(), *interceptors],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.server.max_pending_requests", max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", max_pending_calls),
        ],
    )
    for add in register:
        add(server)
    health_servicer = aio_health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    names = tuple(service_names)
    _add_reflection(server, (*names, health.SERVICE_NAME, reflection.SERVICE_NAME))
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.credentials())
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc}") from exc
    handle = ServerHandle(server, health_servicer, port, names, asyncio.get_running_loop())
    await handle.set_ready(False)
    return handle


class LoopThread:
    """An asyncio event loop on its own daemon thread, for running servers inside a process
    that is not itself asyncio (tests, benchmarks). `run(coro)` runs a coroutine there and
    returns its result."""

    def __init__(self, name: str = "aio-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout_s: float | None = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class EngineLoop:
    """Where a worker's engine loop runs: its own thread by default, or the process's main
    thread while the `grpc.aio` server runs on another one (`serve_on_side_thread`).

    NOTE: one thread of the process computes with several torch threads, and the main one is
    the safe choice: libgomp keeps an OpenMP team per thread that enters a parallel region, and
    once the process holds more OpenMP threads than cores it stops spinning between regions, so
    every one of a step's thousands of regions waits for a futex wake. Measured on 2 cores,
    SmolLM2, a decode step of 32 sequences: 141 ms alone on the main thread, 277 ms on a side
    thread, 250 ms on the main thread after a side thread ran one torch op with 2 threads,
    124 ms when side threads take one torch thread (`core_share.one_torch_thread`).
    """

    def __init__(self, name: str, *, on_main_thread: bool = False) -> None:
        self.name = name
        self.on_main_thread = on_main_thread
        self._handoff: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._started = False

    def start(self, loop: Callable[[], None]) -> None:
        """Run `loop` (it returns when its worker stops) on the chosen thread."""

        def run() -> None:
            try:
                loop()
            finally:
                self._done.set()

        self._started = True
        if self.on_main_thread:
            self._handoff.put(run)
        else:
            threading.Thread(target=run, name=self.name, daemon=True).start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for a started loop to return; True when it has (or none was started)."""
        return not self._started or self._done.wait(timeout_s)

    def serve_on_side_thread(
        self,
        serve: Callable[[], Awaitable[int]],
        side_thread_init: Callable[[], None] | None = None,
    ) -> int:
        """Main thread only: run `asyncio.run(serve())` on a side thread and the engine loop
        that `serve` starts here; return serve's result once both have ended.

        `side_thread_init` runs first on the side thread and on each thread of its loop's
        default executor (a worker passes `core_share.one_torch_thread`)."""
        result: dict[str, Any] = {}

        async def main() -> int:
            if side_thread_init is not None:
                side_thread_init()
                asyncio.get_running_loop().set_default_executor(
                    ThreadPoolExecutor(
                        thread_name_prefix=f"{self.name}-aio", initializer=side_thread_init
                    )
                )
            return await serve()

        def run_server() -> None:
            try:
                result["rc"] = asyncio.run(main())
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                result["exc"] = exc
            finally:
                self._handoff.put(None)

        side = threading.Thread(target=run_server, name=f"{self.name}-grpc")
        side.start()
        while (loop := self._handoff.get()) is not None:
            loop()
        side.join()
        if "exc" in result:
            raise result["exc"]
        return int(result["rc"])


def time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left of the caller's deadline, or None when it set none.

    NOTE: grpcio reports "no deadline" as ~9.2e18 seconds, which overflows as a client timeout.
    """
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e9 else max(0.0, remaining)


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A server's certificate chain and key (PEM); `client_ca` set: clients must present a
    certificate it signed (mTLS), so only the cluster's own services get in."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """What an outgoing channel trusts (`root_ca`, None: the system roots) and, for mTLS, the
    certificate it presents. `server_name` overrides the name checked against the server's
    certificate (for addresses that are not in it)."""

    root_ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_ca, self.private_key, self.cert_chain)


# NOTE: a restarted worker (or router) comes back at the same address within seconds, but gRPC's
# reconnect back-off grows to 120 s by default, and a call without wait_for_ready fails at once
# (UNAVAILABLE) while its channel waits out the back-off, even with the peer up again
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Channel options for a peer inside the cluster: at most a second between reconnects (the
client distribution's `pagedserve_client.RECONNECT_OPTIONS` are the same, for its channels)."""


def make_channel(
    address: str,
    tls: ClientTLS | None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    aio: bool = False,
) -> Any:
    """A channel to `address`: plaintext when `tls` is None, else TLS (mTLS with a cert).
    `aio`: a `grpc.aio` channel (create it on the event loop that will use it)."""
    module: Any = grpc.aio if aio else grpc
    opts = list(options)
    if tls is None:
        return module.insecure_channel(address, options=opts)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return module.secure_channel(address, tls.credentials(), options=opts)


def health_address(host: str, port: int | None) -> str | None:
    """`--host` and `--health-port` as the address `ServerHandle.add_health_port` takes."""
    return None if port is None else f"{host}:{port}"


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_tls_from_args(args: Any) -> ServerTLS | None:
    """`--tls-cert/--tls-key/--tls-client-ca` -> ServerTLS (None without a cert). ValueError
    names the flag when they do not go together; OSError when a file cannot be read."""
    cert, key, client_ca = (
        getattr(args, n, None) for n in ("tls_cert", "tls_key", "tls_client_ca")
    )
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key: give both or neither")
    if client_ca and not cert:
        raise ValueError("--tls-client-ca: needs --tls-cert and --tls-key")
    if not cert or not key:
        return None
    return ServerTLS(Path(cert).read_bytes(), Path(key).read_bytes(), _read(client_ca))


def client_tls_from_args(args: Any) -> ClientTLS | None:
    """`--tls-ca/--tls-client-cert/--tls-client-key/--tls-server-name` -> ClientTLS for this
    process's outgoing channels (None: plaintext). ValueError names the flag."""
    ca, cert, key, server_name = (
        getattr(args, n, None)
        for n in ("tls_ca", "tls_client_cert", "tls_client_key", "tls_server_name")
    )
    return client_tls_from_files(ca, cert, key, server_name)


def client_tls_from_files(
    ca: str | None, cert: str | None = None, key: str | None = None, server_name: str | None = None
) -> ClientTLS | None:
    """PEM paths -> ClientTLS (None without a CA or a certificate: plaintext). ValueError when
    only one of cert and key is given; OSError when a file cannot be read."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-client-cert and --tls-client-key: give both or neither")
    if not (ca or cert):
        return None
    return ClientTLS(_read(ca), _read(cert), _read(key), server_name)
