"""What the client examples run against: one real cluster for all of them (redis-server, router,
prefill and decode workers as `pagedserve up` starts them, a tiny model with a chat template),
the Python client's answer to compare with, and an overloaded router for RetryInfo (plaintext, and
behind TLS and API keys)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from support.aio_servers import serving
from support.certs import make_certs

from pagedserve.client import Client
from pagedserve.errors import ResourceExhausted
from pagedserve.grpcutil import ServerTLS, build_server
from pagedserve.router.auth import ApiKeys, AuthInterceptor
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2_grpc

RETRY_AFTER_S = 1.5


@pytest.fixture(scope="package")
def cluster(tiny_chat_model, clusters):
    """The shared cluster of the tiny model with a chat template (tests/router/test_chat_e2e.py
    uses it too)."""
    return clusters.get(tiny_chat_model, http_port=0)


@pytest.fixture(scope="package")
def python_answer(cluster):
    """`python_answer(messages, max_tokens) -> str`: what every chat example prints for a greedy
    chat request, made from the Python client's answer: the text, then one line
    `[finish_reason: P prompt tokens, C generated]`."""
    return lambda messages, max_tokens: _answer(cluster.router_address, messages, max_tokens)


def _answer(address: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    with Client(address) as client:
        parts = list(client.chat(messages, SamplingParams(0.0, max_tokens=max_tokens), timeout=60))
    text = "".join(p.text for p in parts)
    usage = parts[-1].usage
    reason = common_pb2.FinishReason.Name(parts[-1].finish_reason).removeprefix("FINISH_REASON_")
    return (
        f"{text}\n[{reason.lower()}: {usage.prompt_tokens} prompt tokens, "
        f"{usage.completion_tokens} generated]\n"
    )


class Overloaded(generation_pb2_grpc.GenerationServicer):
    """Every Generate is refused as a full router queue refuses it (router/generate.py)."""

    async def Generate(self, request, context):  # noqa: N802
        raise ResourceExhausted("router queue is full", retry_after_s=RETRY_AFTER_S)
        yield  # NOTE: an async generator, as the real servicer's streaming method is


@dataclass(frozen=True)
class OverloadedRouter:
    address: str
    retry_after_s: float
    tls_ca: Path | None = None  # PEM of the CA that signed the server's certificate
    api_key: str | None = None  # the one key the server accepts


def _serve_overloaded(tls: ServerTLS | None = None, keys: ApiKeys | None = None):
    build = build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(Overloaded(), s)],
        ["pagedserve.v1.Generation"],
        interceptors=[AuthInterceptor(keys)] if keys else [],
        tls=tls,
    )
    return serving(build)


@pytest.fixture(scope="package")
def overloaded_router():
    """A server built by `build_server` (its ErrorInterceptor writes the trailers) whose Generate
    always fails with RESOURCE_EXHAUSTED + RetryInfo(retry_after_s)."""
    with _serve_overloaded() as handle:
        yield OverloadedRouter(f"127.0.0.1:{handle.port}", RETRY_AFTER_S)


@pytest.fixture(scope="package")
def secure_overloaded_router(tmp_path_factory):
    """`overloaded_router` behind TLS (a test CA's certificate for 127.0.0.1) and the router's
    own API key check (`AuthInterceptor`): UNAUTHENTICATED without `api_key`."""
    certs = make_certs(tmp_path_factory.mktemp("examples-certs"))
    api_key = "example-key-0123456789abcdef"
    keys = ApiKeys.parse(f"tenant-a:{api_key}", "test")
    with _serve_overloaded(certs.server_tls(mtls=False), keys) as handle:
        # NOTE: by name: Node.js warns when a TLS server name is an IP address (RFC 6066)
        yield OverloadedRouter(f"localhost:{handle.port}", RETRY_AFTER_S, certs.ca, api_key)
