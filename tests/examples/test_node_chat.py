"""examples/node against a real cluster (tests/examples/conftest.py): chat.js prints the answer
the Python client gets, a bad request with its BadRequest field, an overload with its RetryInfo,
and speaks TLS with an API key; cancel.js stops a stream both ways and the server ends the
request. Skipped only where
`node` or `npm` is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from example_chat import CHAT_ARGS, CHAT_MAX_TOKENS, CHAT_MESSAGES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="node and npm are needed to run examples/node (install Node.js >= 18)",
)


@pytest.fixture(scope="module")
def node_example() -> Path:
    """examples/node with its dependencies installed (npm ci, from package-lock.json)."""
    dependencies = ("@grpc/grpc-js", "@grpc/proto-loader", "protobufjs")
    if not all((EXAMPLE / "node_modules" / name).is_dir() for name in dependencies):
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE, check=True, timeout=600
        )
    return EXAMPLE


def run_node(
    example: Path, script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(["node", script, *args], cwd=example, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_node_chat_streams_the_answer_the_python_client_gets(node_example, cluster, python_answer):
    out = run_node(node_example, "chat.js", cluster.router_address, *CHAT_ARGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == python_answer(CHAT_MESSAGES, CHAT_MAX_TOKENS)


def test_node_chat_prints_the_bad_field_and_why(node_example, cluster):
    out = run_node(node_example, "chat.js", cluster.router_address, "hi", "--max-tokens", "100000")
    assert out.returncode == 1
    assert out.stderr.startswith("INVALID_ARGUMENT: ")
    assert "\n  field sampling.max_tokens: " in out.stderr
    assert "exceeds the model's context length" in out.stderr.split("  field ", 1)[1]


def test_node_chat_prints_when_to_retry(node_example, overloaded_router):
    out = run_node(node_example, "chat.js", overloaded_router.address, "hi")
    assert out.returncode == 1
    delay = overloaded_router.retry_after_s
    assert out.stderr == f"RESOURCE_EXHAUSTED: router queue is full\n  retry after {delay} s\n"


def test_node_chat_speaks_tls_and_sends_the_api_key(node_example, secure_overloaded_router):
    router = secure_overloaded_router
    env = {**os.environ, "PAGEDSERVE_TLS_CA": str(router.tls_ca)}
    without_key = run_node(node_example, "chat.js", router.address, "hi", env=env)
    assert without_key.stderr == "UNAUTHENTICATED: missing or unknown API key\n"
    env["PAGEDSERVE_API_KEY"] = router.api_key
    out = run_node(node_example, "chat.js", router.address, "hi", env=env)
    assert out.stderr.startswith("RESOURCE_EXHAUSTED: ")  # NOTE: past the TLS handshake and the key


def test_node_cancel_ends_the_request_on_the_server(node_example, cluster):
    out = run_node(node_example, "cancel.js", cluster.router_address, "--after", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "\n[cancelled by the client after 3 responses]\n" in out.stdout
    assert out.stdout.endswith(
        "[server: the request ended; decode workers idle, KV cache usage 0]\n"
    )


def test_node_abort_ends_the_stream_with_finish_reason_abort(node_example, cluster):
    out = run_node(node_example, "cancel.js", cluster.router_address, "--after", "2", "--abort")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "found=true]" in out.stdout
    assert "[abort: the server ended the stream after " in out.stdout
