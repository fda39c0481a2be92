"""The gateway's HTTP app: OpenAI's endpoints over one `grpc.aio` channel to the router.

    HTTP client ──► FastAPI route ──► GenerateRequest(s) ──► router (grpc.aio, streamed)
                        ▲                                          │
                        └──── JSON / SSE chunks ◄── responses.py ◄─┘

Everything runs on one asyncio loop: no thread per request. A streamed request answers its HTTP
status only once the router sent its first message, so that a bad request is a 400 (not a 200
stream that ends in an error); a client that goes away — before or during the stream — cancels
its gRPC calls, and the router aborts the requests and frees their blocks. `Authorization` is
passed to the router as is: the router's API keys decide. The W3C `traceparent` of the client (if
any) parents the gateway's span, whose context travels to the router (one trace per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from pagedserve import __version__
from pagedserve.gateway import responses as out
from pagedserve.gateway import tokenization as tok
from pagedserve.gateway.echo import Echo, echo_choices, echo_of, echo_usage
from pagedserve.gateway.errors import GatewayError, from_rpc_error, invalid
from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.gateway.tools import ToolStream, take_calls
from pagedserve.grpcutil import RECONNECT_OPTIONS, ClientTLS, make_channel
from pagedserve.telemetry import Tracing, context_from, export_registry, metadata, span_context
from pagedserve.v1 import generation_pb2, generation_pb2_grpc

ROUTER_SERVICE = "pagedserve.v1.Generation"  # the router's readiness service in grpc.health
T = TypeVar("T")
Body = CompletionRequest | ChatCompletionRequest


@dataclass(slots=True)
class GatewaySettings:
    router: str  # host:port of the router's gRPC API
    tls: ClientTLS | None = None  # TLS to the router (None: plaintext)
    tracing: Tracing | None = None
    max_message_bytes: int = 64 << 20
    request_timeout_s: float | None = None  # deadline of each Generate call (None: none)
    health_timeout_s: float = 1.0
    metrics_names: str = "pagedserve"  # --metrics-names


class RouterConnection:
    """The gateway's one channel to the router, opened on the serving loop."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.channel: Any = None
        self.stub: generation_pb2_grpc.GenerationStub
        self._health: health_pb2_grpc.HealthStub
        self._model: generation_pb2.ModelInfo | None = None

    async def open(self) -> None:
        size = self.settings.max_message_bytes
        options = [
            ("grpc.max_receive_message_length", size),
            # NOTE: with `--router dns:///<headless service>:50051`, calls spread over every
            # router the name resolves to (a plain address is one backend either way)
            ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
            *RECONNECT_OPTIONS,  # NOTE: `pagedserve up` restarts a router at its address
        ]
        self.channel = make_channel(self.settings.router, self.settings.tls, options, aio=True)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(grace=1.0)

    async def ready(self) -> bool:
        request = health_pb2.HealthCheckRequest(service=ROUTER_SERVICE)
        try:
            answer = await self._health.Check(request, timeout=self.settings.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    async def model_name(self) -> str:
        """The served model's name for the metrics' `model_name` label: the one the router
        last answered; asked for without credentials when not yet known ("" if it refuses)."""
        if self._model is None:
            with contextlib.suppress(GatewayError):
                await self.model_info([])
        return self._model.model_name if self._model is not None else ""

    async def model_info(
        self, md: list[tuple[str, str]], *, fresh: bool = False
    ) -> generation_pb2.ModelInfo:
        """The served model (cached; `fresh` asks the router again). Errors as GatewayError."""
        if self._model is None or fresh:
            try:
                self._model = await self.stub.GetModelInfo(
                    generation_pb2.GetModelInfoRequest(), metadata=md, timeout=10
                )
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, lambda _: None) from None
        return self._model


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or ClientGone (with `awaitable` cancelled) if the client leaves
    first. NOTE: the body was read already, so the next ASGI message is the disconnect."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        raise ClientGone
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: GatewaySettings) -> FastAPI:
    router = RouterConnection(settings)
    metrics = GatewayMetrics()
    tracing = settings.tracing or Tracing(trace.NoOpTracer(), enabled=False, include_text=False)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.open()
        yield
        await router.close()

    app = FastAPI(title="pagedserve (OpenAI-compatible)", lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # fmt: skip
    app.state.router = router
    app.state.metrics = metrics
    _add_error_handlers(app)
    _add_info_routes(app, router, metrics, settings.metrics_names)
    _add_tokenizer_routes(app, router, settings)
    endpoints = Endpoints(router, metrics, tracing, settings)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await endpoints.serve(request, body, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await endpoints.serve(request, body, "chat")

    return app


def _add_info_routes(
    app: FastAPI, router: RouterConnection, metrics: GatewayMetrics, naming: str
) -> None:
    """Health, metrics and the model list."""

    @app.get("/health")
    async def health() -> Response:
        """Readiness: the router answers SERVING (it has a prefill and a decode worker)."""
        if await router.ready():
            return JSONResponse({"status": "ok"})
        error = GatewayError(503, "the router is not ready", type="service_unavailable")
        return JSONResponse(error.body(), status_code=503)

    @app.get("/livez")
    async def livez() -> Response:
        """Liveness: this process's event loop answers (whatever the router's state)."""
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        exported = export_registry(await router.model_name(), naming, metrics.registry)
        return Response(generate_latest(exported), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        info = await router.model_info(_auth(request), fresh=True)
        return JSONResponse({"object": "list", "data": [_model_card(info)]})

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request) -> Response:
        info = await router.model_info(_auth(request), fresh=True)
        if model != info.model_name:
            raise _unknown_model(model)
        return JSONResponse(_model_card(info))


def _add_tokenizer_routes(
    app: FastAPI, router: RouterConnection, settings: GatewaySettings
) -> None:
    """vLLM's `/tokenize`, `/detokenize` and `/version`: the router's tokenizer and chat
    template (gateway/tokenization.py), no worker involved."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = tok.parse_tokenize(await _json_body(request))
        md = _auth(request)
        info = await _served_model(router, md, body.model)
        call = router.stub.Tokenize(
            body.to_proto(), metadata=md, timeout=settings.request_timeout_s
        )
        answer = await _unary(call, tok.tokenize_param)
        with_strs = bool(body.return_token_strs)
        return JSONResponse(tok.tokenize_answer(answer, info.max_model_len, with_strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = tok.parse_detokenize(await _json_body(request))
        md = _auth(request)
        await _served_model(router, md, body.model)
        call = router.stub.Detokenize(
            body.to_proto(), metadata=md, timeout=settings.request_timeout_s
        )
        answer = await _unary(call, tok.detokenize_param)
        return JSONResponse({"prompt": answer.text})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:  # NOTE: UnicodeDecodeError too
        raise invalid(None, "the body is not valid JSON") from None


async def _served_model(
    router: RouterConnection, md: list[tuple[str, str]], model: str | None
) -> generation_pb2.ModelInfo:
    """The served model's info; 404 when the body names another (None: the served one)."""
    info = await router.model_info(md)
    if model is not None and model != info.model_name:
        info = await router.model_info(md, fresh=True)  # NOTE: a new router, maybe
        if model != info.model_name:
            raise _unknown_model(model)
    return info


async def _unary(call: Awaitable[T], param_of: Callable[[str], str | None]) -> T:
    """A unary call's answer; its error as GatewayError."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, param_of) from None


def _model_card(info: generation_pb2.ModelInfo) -> dict[str, Any]:
    return {
        "id": info.model_name, "object": "model", "created": 0, "owned_by": "pagedserve",
        "root": info.model_name, "max_model_len": info.max_model_len,
    }  # fmt: skip


def _unknown_model(model: str) -> GatewayError:
    return GatewayError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def _auth(request: Request) -> list[tuple[str, str]]:
    """The client's `Authorization`, for the router (which checks it)."""
    value = request.headers.get("authorization")
    if value is None:
        return []
    if not value.isascii() or not value.isprintable():
        raise GatewayError(401, "malformed Authorization header", type="authentication_error",
                           code="invalid_api_key")  # fmt: skip
    return [("authorization", value)]


class Endpoints:
    """`/v1/completions` and `/v1/chat/completions`: one body in, JSON or an SSE stream out."""

    def __init__(
        self,
        router: RouterConnection,
        metrics: GatewayMetrics,
        tracing: Tracing,
        settings: GatewaySettings,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.tracing = tracing
        self.settings = settings

    async def serve(self, request: Request, body: Body, endpoint: str) -> Response:
        span = self.tracing.tracer.start_span(
            f"POST /v1/{'chat/' if endpoint == 'chat' else ''}completions",
            context=context_from(dict(request.headers)),
            kind=trace.SpanKind.SERVER,
        )
        done = ResponseRecorder(self.metrics, span, endpoint)
        try:
            response = await self._answer(request, body, endpoint, done)
        except GatewayError as exc:
            done.finish(exc.status, exc.message)
            raise
        except ClientGone:
            done.finish(499, "client disconnected")
            return Response(status_code=499)
        except BaseException:
            done.finish(500, "internal error")
            raise
        if not isinstance(response, StreamingResponse):
            done.finish(200)
        return response

    async def _answer(
        self, request: Request, body: Body, endpoint: str, done: ResponseRecorder
    ) -> Response:
        span, started = done.span, done.started
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        span.set_attribute("pagedserve.request_id", request_id)
        span.set_attribute("gen_ai.request.model", body.model)
        span.set_attribute("pagedserve.stream", body.stream)
        md = _auth(request) + metadata(span_context(span))
        info = await self.router.model_info(md)
        if body.model != info.model_name:
            info = await self.router.model_info(md, fresh=True)  # NOTE: a new router, maybe
            if body.model != info.model_name:
                raise _unknown_model(body.model)
        generate = body.generate_requests(request_id)
        echo = await echo_of(body, self.router.stub, md, self.settings.request_timeout_s)
        wants_logprobs = body.logprobs is not None and body.logprobs is not False
        env = out.Envelope(request_id, int(time.time()), body.model, wants_logprobs)
        timeout = self.settings.request_timeout_s
        calls = [self.router.stub.Generate(g, metadata=md, timeout=timeout) for g in generate]
        try:
            if body.stream:
                firsts = await until_disconnect(request, _first_messages(calls, body.param_of))
            else:
                parts = await until_disconnect(request, _all_messages(calls, body.param_of))
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        if not body.stream:
            self.metrics.first_token.labels(endpoint).observe(time.monotonic() - started)
            choices = choices_of(parts, body.samples, echo)
            used = echo_usage(echo, out.usage(p[-1] for p in parts if p))
            if isinstance(body, ChatCompletionRequest):
                tools = (body.tool_plan(), info.tool_call_parser)
                return JSONResponse(out.chat_completion(env, choices, used, tools))
            return JSONResponse(out.completion(env, choices, used))
        self.metrics.first_token.labels(endpoint).observe(time.monotonic() - started)
        stream = Stream(env, endpoint, body, calls, firsts, info.tool_call_parser, echo)
        return EventStream(stream, done)


class ResponseRecorder:
    """Records how one HTTP request ended (its status), once: the gateway's metrics and the end
    of its span. Not the router's `Outcome` (generation stats of one request)."""

    def __init__(self, metrics: GatewayMetrics, span: trace.Span, endpoint: str) -> None:
        self.metrics, self.span, self.endpoint = metrics, span, endpoint
        self.started = time.monotonic()
        self.finished = False
        metrics.in_flight.inc()

    def finish(self, status: int, error: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(self.endpoint, str(status)).inc()
        self.metrics.duration.labels(self.endpoint).observe(time.monotonic() - self.started)
        self.span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self.span.end()


class EventStream(StreamingResponse):
    """A streamed answer (SSE). Whatever ends the response — the last chunk, a router error
    (sent as OpenAI's error event), the client leaving, even before the first byte — cancels
    the router calls and records the response's status."""

    def __init__(self, stream: Stream, recorder: ResponseRecorder) -> None:
        super().__init__(
            self._events(stream, recorder),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.stream, self.recorder = stream, recorder

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()
            self.recorder.finish(499, "client disconnected")

    @staticmethod
    async def _events(stream: Stream, recorder: ResponseRecorder) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream.chunks():
                yield chunk
        except GatewayError as exc:  # NOTE: after the 200: an error event, as vLLM sends
            recorder.finish(exc.status, exc.message)
            yield out.sse(exc.body())
            yield out.sse("[DONE]")
            return
        recorder.finish(200)


def choices_of(
    answers: list[list[generation_pb2.GenerateResponse]], samples: int, echo: Echo | None = None
) -> list[out.Choice]:
    """Every prompt's answer (one message per sample) as choices `p * samples + i`."""
    choices = [out.Choice(i) for i in range(len(answers) * samples)]
    echo_choices(echo, choices, samples)
    for call, parts in enumerate(answers):
        for part in parts:
            choices[choice_index(call, part, samples)].add(part)
    return choices


def choice_index(call: int, part: generation_pb2.GenerateResponse, samples: int) -> int:
    """The choice of sample `part.index` of prompt `call`, as vLLM numbers them."""
    if part.index >= samples:
        raise RuntimeError(f"the router sent sample {part.index} of a request with n = {samples}")
    return call * samples + part.index


async def _read(
    call: Any, param_of: Callable[[str], str | None]
) -> generation_pb2.GenerateResponse | None:
    """The call's next message (None at its end); its error as GatewayError."""
    try:
        message = await call.read()
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, param_of) from None
    return None if message is grpc.aio.EOF else message


async def _first_messages(
    calls: list[Any], param_of: Callable[[str], str | None]
) -> list[generation_pb2.GenerateResponse | None]:
    return list(await asyncio.gather(*(_read(call, param_of) for call in calls)))


async def _all_messages(
    calls: list[Any], param_of: Callable[[str], str | None]
) -> list[list[generation_pb2.GenerateResponse]]:
    async def drain(call: Any) -> list[generation_pb2.GenerateResponse]:
        parts = []
        while (part := await _read(call, param_of)) is not None:
            parts.append(part)
        return parts

    return list(await asyncio.gather(*(drain(call) for call in calls)))


class Stream:
    """One streamed request's SSE chunks: its prompts' gRPC streams merged in arrival order,
    each message a chunk of the choice of its prompt and sample (`choice_index`)."""

    def __init__(
        self,
        env: out.Envelope,
        endpoint: str,
        body: Body,
        calls: list[Any],
        firsts: list[generation_pb2.GenerateResponse | None],
        parser: str = "",
        echo: Echo | None = None,
    ) -> None:
        self.env = env
        self.chat = endpoint == "chat"
        self.kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.body = body
        self.calls = calls
        self.firsts = firsts
        self.samples = body.samples
        self.choices = [out.Choice(i) for i in range(len(calls) * self.samples)]
        self.echo = echo_choices(echo, self.choices, self.samples)
        self.lasts: list[generation_pb2.GenerateResponse | None] = [None] * len(calls)
        self._tasks: list[asyncio.Task] = []
        plan = body.tool_plan() if isinstance(body, ChatCompletionRequest) else None
        self.tools = ToolStream.per_choice(plan, parser, len(self.choices))

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.chat:
            for choice in self.choices:
                yield out.sse(self._with_usage(out.chat_chunk(self.env, choice, None, first=True)))
        async for call, part in self._parts():
            self.lasts[call] = part
            choice = self.choices[choice_index(call, part, self.samples)]
            choice.add(part)
            tool_calls = take_calls(self.tools, choice, part)
            if tool_calls:
                if choice.text or choice.logprobs:
                    chunk = out.chat_chunk(self.env, choice, generation_pb2.GenerateResponse())
                    yield out.sse(self._with_usage(chunk, choice))
                chunk = out.tool_calls_chunk(self.env, choice, tool_calls, part)
                yield out.sse(self._with_usage(chunk, choice))
            elif choice.text or part.logprobs or part.finish_reason:
                build = out.chat_chunk if self.chat else out.completion_chunk
                yield out.sse(self._with_usage(build(self.env, choice, part), choice))
        if self.body.include_usage:
            yield out.sse(out.usage_chunk(self.env, self.kind, self._usage()))
        yield out.sse("[DONE]")

    def _with_usage(self, chunk: dict[str, Any], choice: out.Choice | None = None) -> dict:
        """OpenAI: `usage: null` on every chunk with include_usage; vLLM's
        continuous_usage_stats: the running usage instead."""
        if self.body.continuous_usage:
            chunk["usage"] = self._usage()
        elif self.body.include_usage:
            chunk["usage"] = None
        return chunk

    def _usage(self) -> dict[str, Any]:
        """Every prompt's latest usage (each counts all of its samples), summed."""
        return echo_usage(self.echo, out.usage(last for last in self.lasts if last))

    async def _parts(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        """(prompt, message) of every call, in arrival order."""
        for index, first in enumerate(self.firsts):
            if first is not None:
                yield index, first
        if len(self.calls) == 1:
            while (part := await _read(self.calls[0], self.body.param_of)) is not None:
                yield 0, part
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._pump(i, call, queue)) for i, call in enumerate(self.calls)
        ]
        for _ in self.calls:
            while (item := await queue.get()) is not None:
                if isinstance(item, GatewayError):
                    raise item
                yield item

    async def _pump(self, index: int, call: Any, queue: asyncio.Queue) -> None:
        try:
            while (part := await _read(call, self.body.param_of)) is not None:
                queue.put_nowait((index, part))
        except GatewayError as exc:
            queue.put_nowait(exc)
        queue.put_nowait(None)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        for call in self.calls:
            call.cancel()


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        # NOTE: pydantic names the union member that failed (`str`, `list[str]`): drop it
        param = loc[0] if loc else None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "")
        return JSONResponse(GatewayError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        error = GatewayError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)
