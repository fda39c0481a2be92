"""examples/go against a real cluster (tests/examples/conftest.py): the answer the Python client
gets, a bad request with its BadRequest field, an overload with its RetryInfo. The binary is built
by the example's own build.sh: Go stubs generated from protos/ by protoc-gen-go and
protoc-gen-go-grpc, compiled GOPATH-style against Debian's grpc-go (no module proxy), Go's build
cache under .cache/go. Skipped only where the Go toolchain is not installed (Debian: `make
go-grpc`, which `make test` runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from example_chat import CHAT_ARGS, CHAT_MAX_TOKENS, CHAT_MESSAGES

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "go"
# NOTE: Debian's golang-google-grpc-dev puts grpc-go's source here (GOPATH-style)
GRPC_GO = Path("/usr/share/gocode/src/google.golang.org/grpc")
TOOLS = ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")


def _missing_toolchain() -> str | None:
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if not GRPC_GO.is_dir():
        missing.append(f"grpc-go ({GRPC_GO})")
    return ", ".join(missing) + " not found" if missing else None


MISSING = _missing_toolchain()
pytestmark = pytest.mark.skipif(
    MISSING is not None,
    reason=f"{MISSING}: examples/go needs Go, protoc and Debian's grpc-go (make go-grpc)",
)


@pytest.fixture(scope="module")
def go_chat(tmp_path_factory) -> Path:
    """The example's binary, built by build.sh (stubs generated from the current protos)."""
    binary = tmp_path_factory.mktemp("go-example") / "pagedserve-chat"
    # NOTE: GOPATH and GOCACHE stay in .cache/go (build.sh), so a repeat build is about a second
    subprocess.run(
        [str(EXAMPLE / "build.sh"), str(binary)], check=True, capture_output=True, timeout=600
    )
    return binary


def run_go(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )


def test_go_chat_streams_the_answer_the_python_client_gets(go_chat, cluster, python_answer):
    out = run_go(go_chat, cluster.router_address, *CHAT_ARGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == python_answer(CHAT_MESSAGES, CHAT_MAX_TOKENS)


def test_go_chat_prints_the_bad_field_and_why(go_chat, cluster):
    out = run_go(go_chat, cluster.router_address, "hi", "--max-tokens", "100000")
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("INVALID_ARGUMENT: ")
    assert "\n  field sampling.max_tokens: " in out.stderr
    assert "exceeds the model's context length" in out.stderr.split("  field ", 1)[1]


def test_go_chat_prints_when_to_retry(go_chat, overloaded_router):
    out = run_go(go_chat, overloaded_router.address, "hi")
    assert out.returncode == 1, out.stderr
    delay = overloaded_router.retry_after_s
    assert out.stderr == f"RESOURCE_EXHAUSTED: router queue is full\n  retry after {delay} s\n"


def test_go_example_is_gofmt_clean():
    out = subprocess.run(["gofmt", "-l", str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, ""), out.stderr
