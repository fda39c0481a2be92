"""examples/ruby/chat.rb against a real cluster (tests/examples/conftest.py): the answer the
Python client gets, a bad request with its BadRequest field, an overload with its RetryInfo.
The classes are generated from protos/ by the example's own `rake`. Skipped only where the Ruby
toolchain is not installed (Debian: `apt-get install ruby-grpc ruby-grpc-tools`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from example_chat import CHAT_ARGS, CHAT_MAX_TOKENS, CHAT_MESSAGES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ruby"


def _missing_toolchain() -> str | None:
    """What is not installed, or None; a grpc gem that is installed but fails to load is a
    failure of the tests, not a reason to skip them."""
    missing = [
        tool for tool in ("ruby", "rake", "grpc_tools_ruby_protoc") if not shutil.which(tool)
    ]
    if missing:
        return ", ".join(missing) + " not found"
    probe = ["ruby", "-e", "begin; require 'grpc'; rescue LoadError; exit 3; end"]
    absent = subprocess.run(probe, capture_output=True, timeout=60).returncode == 3
    return "the grpc gem is not installed" if absent else None


MISSING = _missing_toolchain()
pytestmark = pytest.mark.skipif(
    MISSING is not None,
    reason=f"{MISSING}: examples/ruby needs ruby, rake, the grpc gem and grpc_tools_ruby_protoc "
    "(Debian: apt-get install ruby-grpc ruby-grpc-tools)",
)


@pytest.fixture(scope="module")
def ruby_example() -> Path:
    """examples/ruby with lib/ generated from the current protos (its `rake`)."""
    subprocess.run(["rake"], cwd=EXAMPLE, check=True, capture_output=True, timeout=120)
    return EXAMPLE


def run_ruby(example: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ruby", "chat.rb", *args], cwd=example, capture_output=True, text=True, timeout=120
    )


def test_ruby_chat_streams_the_answer_the_python_client_gets(ruby_example, cluster, python_answer):
    out = run_ruby(ruby_example, cluster.router_address, *CHAT_ARGS)
    assert out.returncode == 0, out.stderr
    assert out.stdout == python_answer(CHAT_MESSAGES, CHAT_MAX_TOKENS)


def test_ruby_chat_prints_the_bad_field_and_why(ruby_example, cluster):
    out = run_ruby(ruby_example, cluster.router_address, "hi", "--max-tokens", "100000")
    assert out.returncode == 1
    assert out.stderr.startswith("INVALID_ARGUMENT: ")
    assert "\n  field sampling.max_tokens: " in out.stderr
    assert "exceeds the model's context length" in out.stderr.split("  field ", 1)[1]


def test_ruby_chat_prints_when_to_retry(ruby_example, overloaded_router):
    out = run_ruby(ruby_example, overloaded_router.address, "hi")
    assert out.returncode == 1
    delay = overloaded_router.retry_after_s
    assert out.stderr == f"RESOURCE_EXHAUSTED: router queue is full\n  retry after {delay} s\n"
