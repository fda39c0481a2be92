"""The generated code that pagedserve-client ships (clients/python/pagedserve_client/{v1,rpc}/):
fresh, the same public API as pagedserve.v1, gencode no newer than the protobuf floor the client
declares, and typed results that carry every field of their message."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from pagedserve.v1 import common_pb2, generation_pb2
from pagedserve_client import types
from pagedserve_client.v1 import common_pb2 as client_common_pb2

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"
PACKAGES = ("v1", "rpc")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
# NOTE: `make client-protoc` builds it (a dependency of `make test`), as for guidellm
CLIENT_PROTOC = Path(
    os.environ.get("PAGEDSERVE_CLIENT_PROTOC", REPO / ".cache/client-protoc-venv/bin/python")
)


def generated(root: Path) -> dict[str, bytes]:
    return {
        f"{package}/{path.name}": path.read_bytes()
        for package in PACKAGES
        for path in sorted((root / package).iterdir())
        if path.name.endswith(GENERATED_SUFFIXES)
    }


def serialized_file(path: Path) -> bytes:
    """The FileDescriptorProto bytes a generated _pb2.py adds to the descriptor pool."""
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", path.read_text(), re.S)
    assert match, path
    return ast.literal_eval(match.group(1))


def test_client_generated_code_matches_a_fresh_generation(tmp_path):
    assert CLIENT_PROTOC.exists(), "no client protoc: run `make client-protoc`"
    result = subprocess.run(
        [str(CLIENT_PROTOC), str(REPO / "scripts" / "gen_client_protos.py"), "--out", tmp_path],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    fresh, committed = (
        generated(tmp_path / "pagedserve_client"),
        generated(CLIENT / "pagedserve_client"),
    )
    assert len(fresh) == 7
    stale = sorted(
        name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name)
    )
    assert not stale, f"stale generated files in clients/python: {stale}; run make protos"


@pytest.mark.parametrize("name", ["common", "generation"])
def test_client_ships_the_api_the_server_compiles(name):
    # NOTE: needs no toolchain; and identical bytes are what lets both load in one process
    ours = serialized_file(CLIENT / "pagedserve_client" / "v1" / f"{name}_pb2.py")
    servers = serialized_file(REPO / "protos" / "pagedserve" / "v1" / f"{name}_pb2.py")
    assert ours == servers


def test_client_gencode_is_no_newer_than_its_protobuf_floor():
    """A protobuf runtime refuses gencode newer than itself (the 5.26+ check): the client's
    gencode version must be the floor it declares, and carry no stricter check of its own."""
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    (floor,) = re.findall(r"protobuf>=([\d.]+),<8", " ".join(project["dependencies"]))
    for path in (CLIENT / "pagedserve_client").glob("*/*_pb2.py"):
        text = path.read_text()
        assert f"# Protobuf Python Version: {floor}\n" in text, path
        assert "ValidateProtobufRuntimeVersion" not in text, path


def test_server_and_client_modules_share_message_classes():
    assert client_common_pb2.SamplingParams is common_pb2.SamplingParams


@pytest.mark.parametrize(
    ("result", "message", "left_out"),
    [
        (types.ModelInfo, generation_pb2.ModelInfo, set()),
        (types.Usage, common_pb2.Usage, set()),
        (types.WorkerLoad, common_pb2.LoadReport, {"worker_id", "role"}),  # on WorkerStatus
        (types.WorkerStatus, generation_pb2.WorkerStatus, set()),
        (types.ClusterStatus, generation_pb2.ClusterStatus, set()),
        # NOTE: logprobs stay on `raw`; matched_stop's two members are `stop`
        (types.GenerateChunk, generation_pb2.GenerateResponse,
         {"logprobs", "prompt_logprobs", "stop_string", "stop_token_id"}),
    ],
)  # fmt: skip
def test_typed_results_carry_every_field_of_their_message(result, message, left_out):
    fields = {f.name for f in dataclasses.fields(result)} - {"raw", "stop"}
    assert fields == {f.name for f in message.DESCRIPTOR.fields} - left_out


def test_a_chunk_names_its_finish_reason_and_matched_stop():
    last = generation_pb2.GenerateResponse(
        token_ids=[5], finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=5
    )
    chunk = types.GenerateChunk.from_proto(last)
    assert (chunk.finish_reason, chunk.stop, chunk.token_ids) == ("stop", 5, (5,))
    middle = types.GenerateChunk.from_proto(generation_pb2.GenerateResponse(text="a"))
    assert (middle.finish_reason, middle.stop) == (None, None)
    assert set(types.FINISH_REASONS) == set(common_pb2.FinishReason.values()) - {0}
