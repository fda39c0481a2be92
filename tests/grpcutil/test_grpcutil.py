"""`build_server` and `ErrorInterceptor` on a real asyncio gRPC server over loopback."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status
from support.aio_servers import serving

from pagedserve.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from pagedserve.grpcutil import EngineLoop, build_server
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

SERVICE = "pagedserve.v1.Generation"


class ScriptedGeneration(generation_pb2_grpc.GenerationServicer):
    """Raises what the request text names, to exercise each mapping through the wire."""

    async def Tokenize(self, request, context):
        if request.text == "bad":
            raise InvalidArgument("text", "must not be 'bad'")
        if request.text == "busy":
            raise ResourceExhausted("queue full", retry_after_s=1.5)
        if request.text == "gone":
            raise Unavailable("decode worker lost")
        if request.text == "dup":
            raise AlreadyExists("request_id: 'x' is already running")
        if request.text == "bug":
            raise KeyError("oops")
        if request.text == "self-abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
        return generation_pb2.TokenizeResponse(token_ids=[1, 2])

    async def Generate(self, request, context):
        yield generation_pb2.GenerateResponse(request_id="r", token_ids=[7])
        raise InvalidArgument("sampling.top_p", "must be in (0, 1], got 2")


@pytest.fixture
def server():
    build = build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(ScriptedGeneration(), s)],
        [SERVICE],
        max_message_bytes=1024 * 1024,
    )
    with serving(build, ready=False) as handle:
        channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
        yield handle, channel
        channel.close()


def call_tokenize(channel, text):
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(generation_pb2.TokenizeRequest(text=text), timeout=5)
    return info.value


def test_invalid_argument_names_the_field(server):
    _, channel = server
    err = call_tokenize(channel, "bad")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    (detail,) = rpc_status.from_call(err).details
    bad_request = error_details_pb2.BadRequest()
    assert detail.Unpack(bad_request)
    assert bad_request.field_violations[0].field == "text"
    assert "bad" in bad_request.field_violations[0].description


def test_overload_carries_retry_info(server):
    _, channel = server
    err = call_tokenize(channel, "busy")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = error_details_pb2.RetryInfo()
    assert rpc_status.from_call(err).details[0].Unpack(retry)
    assert retry.retry_delay.ToNanoseconds() == 1_500_000_000


def test_unavailable_bug_and_own_abort(server):
    _, channel = server
    assert call_tokenize(channel, "gone").code() == grpc.StatusCode.UNAVAILABLE
    dup = call_tokenize(channel, "dup")
    assert dup.code() == grpc.StatusCode.ALREADY_EXISTS and "already running" in dup.details()
    bug = call_tokenize(channel, "bug")
    assert bug.code() == grpc.StatusCode.INTERNAL
    assert "oops" not in bug.details(), "internal details must not leak to clients"
    assert call_tokenize(channel, "self-abort").code() == grpc.StatusCode.PERMISSION_DENIED
    ok = generation_pb2_grpc.GenerationStub(channel).Tokenize(
        generation_pb2.TokenizeRequest(text="fine"), timeout=5
    )
    assert list(ok.token_ids) == [1, 2]


def test_streaming_error_after_a_message(server):
    _, channel = server
    stream = generation_pb2_grpc.GenerationStub(channel).Generate(
        generation_pb2.GenerateRequest(), timeout=5
    )
    first = next(stream)
    assert list(first.token_ids) == [7]
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    rpc_status.from_call(info.value).details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "sampling.top_p"


def test_health_alive_then_ready(server):
    handle, channel = server
    health = health_pb2_grpc.HealthStub(channel)

    def status(name):
        return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

    assert status("") == health_pb2.HealthCheckResponse.SERVING
    assert status(SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    asyncio.run_coroutine_threadsafe(handle.set_ready(True), handle.loop).result(5)
    assert status(SERVICE) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_lists_the_service_in_v1alpha_and_v1(server, version):
    _, channel = server
    # NOTE: v1's messages are v1alpha's field for field: v1alpha's classes speak v1 too
    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listing, files = list(info(iter(requests), timeout=5))
    names = {s.name for s in listing.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    assert files.file_descriptor_response.file_descriptor_proto  # the service's .proto


def test_message_size_limit_is_enforced(server):
    _, channel = server
    err = call_tokenize(channel, "x" * (2 * 1024 * 1024))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_engine_loop_runs_on_the_main_thread_beside_the_server_thread():
    """A worker's server runs on a side thread, its engine loop on the main one; the side
    thread and its default executor get `side_thread_init` first."""
    ran: dict[str, str] = {}
    inits: list[str] = []
    stop = threading.Event()
    engine_loop = EngineLoop("test-loop", on_main_thread=True)

    def loop() -> None:
        ran["loop"] = threading.current_thread().name
        stop.wait(10)

    async def serve() -> int:
        ran["server"] = threading.current_thread().name
        engine_loop.start(loop)
        await asyncio.to_thread(lambda: None)  # the default executor, initialised
        stop.set()
        assert engine_loop.join(10), "the loop returned on the main thread"
        return 7

    def init() -> None:
        inits.append(threading.current_thread().name)

    assert engine_loop.serve_on_side_thread(serve, init) == 7
    assert ran == {"loop": "MainThread", "server": "test-loop-grpc"}
    assert inits[0] == "test-loop-grpc" and inits[1].startswith("test-loop-aio")


def test_engine_loop_on_its_own_thread_and_a_failing_server():
    engine_loop = EngineLoop("own")
    seen: list[str] = []
    engine_loop.start(lambda: seen.append(threading.current_thread().name))
    assert engine_loop.join(5) and seen == ["own"]
    assert EngineLoop("never").join(0), "nothing started: nothing to wait for"
    assert EngineLoop("never", on_main_thread=True).join(0), "nor on the main thread"

    async def broken() -> int:
        raise RuntimeError("bind failed")

    with pytest.raises(RuntimeError, match="bind failed"):
        EngineLoop("main", on_main_thread=True).serve_on_side_thread(broken)


class SlowTokenize(generation_pb2_grpc.GenerationServicer):
    async def Tokenize(self, request, context):
        await asyncio.sleep(0.5)
        return generation_pb2.TokenizeResponse(token_ids=[1])


BURST = 3000  # gRPC core's own pending limit (soft 1000, hard 3000) drops ~700 of these


def test_a_burst_of_calls_reaches_the_servicer_none_cancelled_by_grpc():
    build = build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(SlowTokenize(), s)],
        [SERVICE],
    )

    async def burst(port: int) -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one() -> grpc.StatusCode:
                try:
                    await stub.Tokenize(generation_pb2.TokenizeRequest(text="x"), timeout=60)
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            return await asyncio.gather(*[one() for _ in range(BURST)])

    with serving(build) as handle:
        codes = asyncio.run(burst(handle.port))
    assert codes == [grpc.StatusCode.OK] * BURST, {c: codes.count(c) for c in set(codes)}


def test_max_pending_calls_must_be_positive():
    with pytest.raises(ValueError, match="max_pending_calls"):
        asyncio.run(build_server([], [SERVICE], max_pending_calls=0))
