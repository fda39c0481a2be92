"""examples/node/chat.js against a real cluster (redis-server, router, prefill and decode
workers as `pagedserve up` starts them): the same answer as the Python client, and a bad request
reported with its field. Skipped only where `node` or `npm` is not installed."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
from chat_templates import CHATML, model_with_template

from pagedserve.client import Client
from pagedserve.launcher import start_cluster
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="node and npm are needed to run examples/node (install Node.js >= 18)",
)


@pytest.fixture(scope="module")
def node_example() -> Path:
    """examples/node with its dependencies installed (npm ci, from package-lock.json)."""
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE, check=True, timeout=600
        )
    return EXAMPLE


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    model_dir = model_with_template(tiny_llama, tmp_path_factory.mktemp("node") / "m", CHATML)
    args = argparse.Namespace(
        model=str(model_dir), host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None,
        block_size=16, dtype=None, kv_cache_memory="16MiB", start_timeout=120.0, log_dir=None,
    )  # fmt: skip
    started = start_cluster(args, tmp_path_factory.mktemp("node-logs"))
    yield started
    started.stop()


def run_node(example: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["node", "chat.js", *args], cwd=example, capture_output=True, text=True, timeout=120
    )


def test_node_chat_streams_the_answer_the_python_client_gets(node_example, cluster):
    out = run_node(node_example, cluster.router_address, "Name a colour.",
                   "--system", "You are brief.", "--max-tokens", "8")  # fmt: skip
    assert out.returncode == 0, out.stderr
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    with Client(cluster.router_address) as client:
        parts = list(client.chat(messages, SamplingParams(0.0, max_tokens=8), timeout=60))
    text = "".join(p.text for p in parts)
    usage = parts[-1].usage
    reason = common_pb2.FinishReason.Name(parts[-1].finish_reason).removeprefix("FINISH_REASON_")
    assert out.stdout == (
        f"{text}\n[{reason.lower()}: {usage.prompt_tokens} prompt tokens, "
        f"{usage.completion_tokens} generated]\n"
    )


def test_node_chat_reports_a_bad_field(node_example, cluster):
    out = run_node(node_example, cluster.router_address, "hi", "--max-tokens", "100000")
    assert out.returncode == 1
    assert out.stderr.startswith("INVALID_ARGUMENT: ")
    assert "(field sampling.max_tokens)" in out.stderr
