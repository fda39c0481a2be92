"""`pagedserve up`: `--served-model-name` through every API, every service's `--log-format
json` / `--log-level`, and a child that fails at start (one line, no traceback)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from pagedserve.client import Client
from pagedserve.kvstore.worker_registry import WorkerRegistry, connect

NAME = "house-model"


@pytest.fixture(scope="module")
def cluster(tiny_llama, clusters):
    """A private cluster serving the tiny model as NAME, every service logging JSON lines."""
    flags = dict(served_model_name=NAME, http_port=0, log_format="json")
    with clusters.private(tiny_llama, **flags) as started:
        yield started


def log_of(cluster, name: str) -> str:
    return next(c for c in cluster.children if c.name == name).log_path.read_text()


def test_the_served_model_name_is_the_models_name_in_every_api(cluster, tiny_llama):
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    answer = client.completions.create(model=NAME, prompt="The oven", max_tokens=3)
    assert answer.model == NAME and answer.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as refused:  # the directory's name is not served
        client.completions.create(model=tiny_llama.name, prompt="The oven", max_tokens=3)
    assert refused.value.body["code"] == "model_not_found"
    with Client(cluster.router_address) as grpc_client:
        assert grpc_client.model_info().model_name == NAME
    registry = WorkerRegistry(connect(cluster.redis_url), NAME)
    assert sorted(w.worker_id for w in registry.live_workers()) == ["decode-0", "prefill-0"]
    assert WorkerRegistry(connect(cluster.redis_url), tiny_llama.name).live_workers() == []


def test_every_service_writes_json_lines_with_the_request_id(cluster):
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model=NAME, prompt="A cat", max_tokens=2)
    for name in ("router", "prefill-0", "decode-0", "gateway"):
        records = [json.loads(line) for line in log_of(cluster, name).splitlines() if line]
        assert records, name
        for record in records:
            assert {"ts", "level", "logger", "message"} <= record.keys(), (name, record)
    finished = [json.loads(line) for line in log_of(cluster, "router").splitlines()]
    finished = [r for r in finished if r["message"].startswith("request_finished")]
    assert answer.id in [r.get("request_id") for r in finished]
    serving = [json.loads(line)["message"] for line in log_of(cluster, "gateway").splitlines()]
    assert any(m.startswith("gateway serving at") for m in serving)  # an info line


def test_log_level_warning_hides_info_lines(cluster, tmp_path):
    log = tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "pagedserve.cli", "gateway", "--router", cluster.router_address,
            "--port", "0", "--log-level", "warning"]  # fmt: skip
    with open(log, "w") as stderr:
        gateway = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert gateway.stdout is not None
        assert gateway.stdout.readline().startswith("READY gateway"), log.read_text()
    finally:
        gateway.terminate()
        gateway.wait(30)
    assert "gateway serving at" not in log.read_text()  # logged at info (the test above)


def test_a_child_that_fails_at_start_ends_up_with_one_line_naming_it(make_tiny, tmp_path):
    model = tmp_path / "broken"
    shutil.copytree(make_tiny("llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"architectures": ["FooForCausalLM"]}))
    up = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "up", "--model", str(model), "--port", "0",
         "--decode", "0", "--kv-cache-memory", "4MiB", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert up.returncode == 1, up.stderr
    assert "Traceback" not in up.stderr
    [line] = up.stderr.strip().splitlines()
    log = Path(tmp_path / "logs" / "prefill-0.log")
    assert line.startswith("pagedserve up: error: prefill-0 did not start (exit status 2): ")
    assert "FooForCausalLM" in line and line.endswith(f"; log: {log}")
    assert "FooForCausalLM" in log.read_text()
