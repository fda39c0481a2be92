"""The `pagedserve-client` distribution (clients/python/) installed ALONE into a fresh venv: no
torch, no pagedserve, no googleapis-common-protos. Offline and honest: grpcio and protobuf (and
grpcio's typing-extensions) are the main venv's, linked into the new venv's site-packages one
distribution at a time, and pip installs the client's wheel there with --no-index, so the install
can only succeed with what the client declares being present.

Against a real cluster: greedy chats, sync and asyncio, equal pagedserve.client.Client's. Against
a tiny in-test server (it tests the CLIENT's retry policy, not pagedserve's servers; its
RESOURCE_EXHAUSTED + RetryInfo trailer is written by the router's own ErrorInterceptor):
UNAVAILABLE (a router restarting, or not listening yet) is retried until the first response and
not after it, RESOURCE_EXHAUSTED is tried again once the RetryInfo delay has passed, and closing
a stream early cancels its call."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from support.aio_servers import serving

from pagedserve.client import Client
from pagedserve.errors import ResourceExhausted
from pagedserve.grpcutil import build_server
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "python"
# NOTE: what the client declares (grpcio, protobuf) and what grpcio itself declares
LINKED = ("grpcio", "protobuf", "typing-extensions")
MESSAGES = [{"role": "user", "content": "Say hello"}]
DELAY_S = 0.4


def link_distribution(name: str, site: Path) -> None:
    """Symlink one installed distribution's top-level modules and dist-info into `site`; in a
    namespace package (google/) only its own sub-packages, so google.rpc does not come along."""
    dist = importlib.metadata.distribution(name)
    base = Path(str(dist.locate_file("")))
    entries = set()
    for file in dist.files or ():
        parts = file.parts
        if parts[0] in ("..", "__pycache__"):
            continue
        top = base / parts[0]
        namespace = (
            top.is_dir() and top.suffix != ".dist-info" and not (top / "__init__.py").exists()
        )
        entries.add(Path(*parts[:2]) if namespace and len(parts) > 2 else Path(parts[0]))
    for entry in entries:
        (site / entry).parent.mkdir(parents=True, exist_ok=True)
        (site / entry).symlink_to(base / entry)


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    """A fresh venv with the client's wheel installed by pip, --no-index, over LINKED only."""
    root = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], check=True)
    python = root / "venv" / "bin" / "python"
    site = Path(run_in(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    for name in LINKED:
        link_distribution(name, site)
    source = shutil.copytree(
        CLIENT_DIR, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", root / "wheels", source], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (root / "wheels").glob("pagedserve_client-*.whl")
    subprocess.run([*pip, "--python", python, "install", "--no-index", wheel], check=True)
    return python


def run_in(python: Path, code: str, *args: str) -> str:
    """Run `code` in `python` isolated (-I: no PYTHONPATH, no user site, no cwd on the path)."""
    result = subprocess.run(
        [str(python), "-I", "-c", code, *args], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_client_installs_and_imports_alone(venv_python):
    code = """
import importlib.metadata, importlib.util, json
import pagedserve_client
print(json.dumps({
    "dists": sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions()),
    "absent": [m for m in ("torch", "pagedserve", "transformers", "google.rpc", "grpc_status")
               if importlib.util.find_spec(m) is None],
    "file": pagedserve_client.__file__,
}))"""
    found = json.loads(run_in(venv_python, code))
    assert found["dists"] == ["grpcio", "pagedserve-client", "protobuf", "typing_extensions"]
    assert found["absent"] == ["torch", "pagedserve", "transformers", "google.rpc", "grpc_status"]
    assert found["file"].startswith(str(venv_python.parents[1]))


CHAT = """
import asyncio, json, sys
from pagedserve_client import AsyncClient, Client

address, messages = sys.argv[1], json.loads(sys.argv[2])

def summary(chunks):
    return {"token_ids": [t for c in chunks for t in c.token_ids],
            "text": "".join(c.text for c in chunks), "chunks": len(chunks),
            "finish": [c.finish_reason for c in chunks],
            "usage": [chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens]}

with Client(address) as client:
    sync = summary(list(client.chat(messages, max_tokens=8, temperature=0.0, timeout=60)))
    model = client.model_info().model_name
    roles = sorted(w.role for w in client.status().workers if w.alive)

async def main():
    async with AsyncClient(address) as client:
        chunks = [c async for c in client.chat(messages, max_tokens=8, temperature=0.0)]
        return summary(chunks), (await client.model_info()).model_name

asynchronous, async_model = asyncio.run(main())
print(json.dumps({"sync": sync, "async": asynchronous, "models": [model, async_model],
                  "roles": roles}))
"""


def test_sync_and_async_chats_equal_the_servers_greedy_answer(
    venv_python, tiny_chat_model, clusters
):
    cluster = clusters.get(tiny_chat_model, http_port=0)
    found = json.loads(run_in(venv_python, CHAT, cluster.router_address, json.dumps(MESSAGES)))
    with Client(cluster.router_address) as client:
        parts = list(client.chat(MESSAGES, SamplingParams(0.0, max_tokens=8), timeout=60))
    expected_ids = [t for p in parts for t in p.token_ids]
    reason = common_pb2.FinishReason.Name(parts[-1].finish_reason).removeprefix("FINISH_REASON_")
    for answer in (found["sync"], found["async"]):
        assert answer["token_ids"] == expected_ids
        assert answer["text"] == "".join(p.text for p in parts)
        assert answer["chunks"] > 1  # streamed: the first token comes alone
        assert answer["finish"] == [None] * (answer["chunks"] - 1) + [reason.lower()]
        assert answer["usage"] == [parts[-1].usage.prompt_tokens, len(expected_ids)]
    assert found["models"] == [tiny_chat_model.name] * 2
    assert "decode" in found["roles"] and "prefill" in found["roles"]


class Scripted(generation_pb2_grpc.GenerationServicer):
    """Generate answers each call by the next step of `script`: "unavailable" (a router that
    is restarting), "overloaded" (the router's full queue: RESOURCE_EXHAUSTED + RetryInfo of
    DELAY_S), "answer" (tokens 1, then 2 and 3), "half" (token 1, then UNAVAILABLE), "hold"
    (token 1, then waits; `cancelled` counts the calls the client cancelled)."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.calls: list[float] = []
        self.cancelled = 0

    async def Generate(self, request, context):  # noqa: N802
        self.calls.append(time.monotonic())
        step = self.script.pop(0)
        if step == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router restarting")
        if step == "overloaded":
            raise ResourceExhausted("router queue is full", retry_after_s=DELAY_S)
        yield generation_pb2.GenerateResponse(token_ids=[1])
        if step == "hold":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if step == "half":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
        yield generation_pb2.GenerateResponse(
            token_ids=[2, 3], finish_reason=common_pb2.FINISH_REASON_LENGTH
        )


@pytest.fixture(scope="module")
def scripted():
    servicer = Scripted()
    build = build_server(
        [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s)],
        ["pagedserve.v1.Generation"],
    )
    with serving(build) as handle:
        yield servicer, f"127.0.0.1:{handle.port}"


def scripted_call(venv_python, scripted, script, mode, max_attempts=3, overload_attempts=3):
    """One generate through the venv's client (`mode`: "sync" or "async") against `script`:
    (what the client got, the server's call times)."""
    servicer, address = scripted
    servicer.script, servicer.calls = list(script), []
    out = json.loads(
        run_in(venv_python, RETRY, address, mode, str(max_attempts), str(overload_attempts))
    )
    return out, servicer.calls


RETRY = """
import asyncio, json, sys, grpc
from pagedserve_client import AsyncClient, Client, RetryPolicy, retry_delay

address, mode = sys.argv[1], sys.argv[2]
policy = RetryPolicy(max_attempts=int(sys.argv[3]), initial_backoff_s=0.05, max_backoff_s=0.1,
                     overload_attempts=int(sys.argv[4]))

async def collect_async():
    async with AsyncClient(address, retry=policy) as client:
        return [c async for c in client.generate("hi", max_tokens=3, timeout=20)]

try:
    if mode == "sync":
        with Client(address, retry=policy) as client:
            chunks = list(client.generate("hi", max_tokens=3, timeout=20))
    else:
        chunks = asyncio.run(collect_async())
    out = {"token_ids": [t for c in chunks for t in c.token_ids],
           "finish": chunks[-1].finish_reason}
except grpc.RpcError as error:
    out = {"error": error.code().name, "retry_delay": retry_delay(error)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unavailable_is_retried_until_the_first_response(venv_python, scripted, mode):
    out, calls = scripted_call(
        venv_python, scripted, ["unavailable", "unavailable", "answer"], mode
    )
    assert out == {"token_ids": [1, 2, 3], "finish": "length"}
    assert len(calls) == 3
    out, calls = scripted_call(
        venv_python, scripted, ["unavailable", "answer"], mode, max_attempts=1
    )
    assert out == {"error": "UNAVAILABLE", "retry_delay": None} and len(calls) == 1


NOT_UP = """
import json, sys
from pagedserve_client import Client, RetryPolicy

with Client(sys.argv[1], retry=RetryPolicy(initial_backoff_s=0.5)) as client:
    print(json.dumps([t for c in client.generate("hi", max_tokens=3) for t in c.token_ids]))
"""


def test_a_router_that_is_not_up_yet_is_retried_until_it_is(venv_python):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    args = [str(venv_python), "-I", "-c", NOT_UP, address]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd="/") as proc:
        try:
            time.sleep(0.3)  # NOTE: the client's first tries find the port closed
            servicer = Scripted()
            servicer.script = ["answer"]
            build = build_server(
                [lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s)],
                ["pagedserve.v1.Generation"],
                address=address,
            )
            with serving(build):
                out, _ = proc.communicate(timeout=20)
        finally:
            proc.kill()
    assert json.loads(out) == [1, 2, 3] and len(servicer.calls) == 1


def test_unavailable_after_the_first_response_reaches_the_caller(venv_python, scripted):
    out, calls = scripted_call(venv_python, scripted, ["half", "answer"], "sync")
    assert out == {"error": "UNAVAILABLE", "retry_delay": None}
    assert len(calls) == 1  # NOTE: gRPC commits a call at its first response


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resource_exhausted_is_retried_after_the_retry_info_delay(venv_python, scripted, mode):
    out, calls = scripted_call(venv_python, scripted, ["overloaded", "overloaded", "answer"], mode)
    assert out == {"token_ids": [1, 2, 3], "finish": "length"}
    assert len(calls) == 3
    assert all(later - earlier >= DELAY_S for earlier, later in zip(calls, calls[1:], strict=False))


def test_resource_exhausted_past_the_attempts_reaches_the_caller_with_its_delay(
    venv_python, scripted
):
    out, calls = scripted_call(
        venv_python, scripted, ["overloaded", "overloaded", "answer"], "sync", overload_attempts=2
    )
    assert out == {"error": "RESOURCE_EXHAUSTED", "retry_delay": DELAY_S}
    assert len(calls) == 2


CLOSE = """
import asyncio, sys, time
from pagedserve_client import AsyncClient, Client

address, mode = sys.argv[1], sys.argv[2]

async def close_async():
    async with AsyncClient(address) as client:
        stream = client.generate("hi", max_tokens=3)
        await stream.__anext__()
        await stream.aclose()
        print("closed", flush=True)
        await asyncio.sleep(30)

if mode == "sync":
    with Client(address) as client:
        stream = client.generate("hi", max_tokens=3)
        next(stream)
        stream.close()
        print("closed", flush=True)
        time.sleep(30)
else:
    asyncio.run(close_async())
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_closing_a_stream_early_cancels_the_call(venv_python, scripted, mode):
    servicer, address = scripted
    servicer.script, servicer.cancelled = ["hold"], 0
    # NOTE: the client stays up after closing: only the close can have cancelled the call
    args = [str(venv_python), "-I", "-c", CLOSE, address, mode]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd="/") as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "closed\n"
            waited = time.monotonic() + 5
            while servicer.cancelled == 0 and time.monotonic() < waited:
                time.sleep(0.02)
            assert proc.poll() is None and servicer.cancelled == 1
        finally:
            proc.kill()
