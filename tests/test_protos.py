"""The gRPC contracts: generated code is fresh, every declaration is commented, shapes hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from pagedserve.internal.v1 import decode_pb2, prefill_pb2, worker_pb2
from pagedserve.v1 import common_pb2, generation_pb2

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
GEN_SCRIPT = REPO / "scripts" / "gen_protos.py"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
# The public API (pagedserve.v1), then the internal worker APIs (pagedserve.internal.v1).
PUBLIC_MODULES = {
    "pagedserve/v1/common.proto": common_pb2,
    "pagedserve/v1/generation.proto": generation_pb2,
}
INTERNAL_MODULES = {
    "pagedserve/internal/v1/worker.proto": worker_pb2,
    "pagedserve/internal/v1/prefill.proto": prefill_pb2,
    "pagedserve/internal/v1/decode.proto": decode_pb2,
}
PROTO_MODULES = PUBLIC_MODULES | INTERNAL_MODULES
PACKAGE_DIRS = ("pagedserve/v1", "pagedserve/internal/v1")

# One declaration per line: a block opener, an rpc, a field (plain, optional, repeated, map) or an
# enum value. `syntax`, `package`, `import`, `option` and `reserved` lines are not declarations.
DECLARATION = re.compile(
    r"^\s*(?:"
    r"(?:message|enum|service|oneof)\s+\w+\s*\{"
    r"|rpc\s+\w+\s*\("
    r"|(?:optional\s+|repeated\s+)?(?:map\s*<[^>]*>|[\w.]+)\s+\w+\s*=\s*\d+"
    r"|[A-Z][A-Z0-9_]*\s*=\s*-?\d+"
    r")"
)
COMMENT_LINE = re.compile(r"^\s*//\s*\S")
TRAILING_COMMENT = re.compile(r";.*//\s*\S|\{\s*//\s*\S")


def generated_files(directory: Path) -> dict[str, bytes]:
    return {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if path.name.endswith(GENERATED_SUFFIXES)
    }


def declarations(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) of every declaration in a .proto text."""
    return [
        (number, line)
        for number, line in enumerate(text.splitlines(), start=1)
        if DECLARATION.match(line)
    ]


def uncommented(text: str) -> list[str]:
    """Declarations with no `//` comment on the line directly above nor trailing on their line."""
    lines = text.splitlines()
    missing = []
    for number, line in declarations(text):
        above = lines[number - 2] if number >= 2 else ""
        if not (COMMENT_LINE.match(above) or TRAILING_COMMENT.search(line)):
            missing.append(f"line {number}: {line.strip()}")
    return missing


def count_declarations(file_proto: descriptor_pb2.FileDescriptorProto) -> int:
    """Declarations the compiler saw in one file: the count `declarations` must find."""

    def in_message(message: descriptor_pb2.DescriptorProto) -> int:
        if message.options.map_entry:  # synthesized for a map field, not written in the text
            return 0
        real_oneofs = {
            field.oneof_index
            for field in message.field
            if field.HasField("oneof_index") and not field.proto3_optional
        }
        return (
            1
            + len(message.field)
            + len(real_oneofs)
            + sum(in_enum(enum) for enum in message.enum_type)
            + sum(in_message(nested) for nested in message.nested_type)
        )

    def in_enum(enum: descriptor_pb2.EnumDescriptorProto) -> int:
        return 1 + len(enum.value)

    return (
        sum(in_message(message) for message in file_proto.message_type)
        + sum(in_enum(enum) for enum in file_proto.enum_type)
        + sum(1 + len(service.method) for service in file_proto.service)
    )


def test_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"gen_protos.py failed:\n{result.stderr}"
    for package in PACKAGE_DIRS:
        fresh = generated_files(tmp_path / package)
        committed = generated_files(PROTO_ROOT / package)
        assert len(fresh) == 3 * sum(name.startswith(f"{package}/") for name in PROTO_MODULES)
        stale = sorted(
            name
            for name in fresh.keys() | committed.keys()
            if fresh.get(name) != committed.get(name)
        )
        assert not stale, f"stale generated files in protos/{package}: {stale}; run make protos"


def test_every_proto_file_is_compiled_into_the_package() -> None:
    found = sorted(str(path.relative_to(PROTO_ROOT)) for path in PROTO_ROOT.rglob("*.proto"))
    assert found == sorted(PROTO_MODULES)


def test_the_public_api_depends_on_no_internal_file() -> None:
    for name, module in PUBLIC_MODULES.items():
        dependencies = [dep.name for dep in module.DESCRIPTOR.dependencies]
        assert all(dep.startswith("pagedserve/v1/") for dep in dependencies), (name, dependencies)
        assert module.DESCRIPTOR.package == "pagedserve.v1"
    for module in INTERNAL_MODULES.values():
        assert module.DESCRIPTOR.package == "pagedserve.internal.v1"


@pytest.mark.parametrize("proto_name", sorted(PROTO_MODULES))
def test_every_file_names_its_package_for_each_language(proto_name: str) -> None:
    """One package per language per proto package (buf lint's PACKAGE_SAME_* rules, kept here
    too so that a missing option fails without buf)."""
    options = PROTO_MODULES[proto_name].DESCRIPTOR.GetOptions()
    internal = "/internal/" in proto_name
    go = "internal/v1;internalv1" if internal else "v1;pagedservev1"
    assert options.go_package == f"github.com/pagedserve/pagedserve/gen/go/pagedserve/{go}"
    assert options.java_package == ("io.pagedserve.internal.v1" if internal else "io.pagedserve.v1")
    assert options.java_multiple_files
    assert options.csharp_namespace == ("Pagedserve.Internal.V1" if internal else "Pagedserve.V1")


def test_every_singular_sampling_param_has_presence() -> None:
    fields = common_pb2.SamplingParams.DESCRIPTOR.fields
    repeated = sorted(field.name for field in fields if field.is_repeated)
    without_presence = [f.name for f in fields if not f.is_repeated and not f.has_presence]
    # logit_bias is a map (a repeated entry message)
    assert repeated == [
        "allowed_token_ids", "bad_word_ids", "bad_words", "logit_bias", "stop", "stop_token_ids"
    ]  # fmt: skip
    assert without_presence == []
    assert len(fields) == 27


def test_explicit_zero_sampling_param_survives_serialization() -> None:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=0)
    decoded = common_pb2.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature")
    assert decoded.HasField("max_tokens")
    assert not decoded.HasField("top_p")


@pytest.mark.parametrize("proto_name", sorted(PROTO_MODULES))
def test_every_declaration_is_commented(proto_name: str) -> None:
    text = (PROTO_ROOT / proto_name).read_text()
    assert uncommented(text) == [], f"{proto_name}: add a // comment above these"


@pytest.mark.parametrize("proto_name", sorted(PROTO_MODULES))
def test_comment_check_sees_every_declaration(proto_name: str) -> None:
    # NOTE: guards the line-based parser: a declaration it cannot recognise (say, split across
    # lines) would otherwise escape the comment rule silently.
    file_proto = descriptor_pb2.FileDescriptorProto()
    PROTO_MODULES[proto_name].DESCRIPTOR.CopyToProto(file_proto)
    text = (PROTO_ROOT / proto_name).read_text()
    assert len(declarations(text)) == count_declarations(file_proto)


def test_comment_check_reports_uncommented_declarations() -> None:
    text = "\n".join(
        [
            "// A thing.",
            "message Thing {",
            "  // Commented above.",
            "  string a = 1;",
            "  string b = 2;",
            "  optional uint32 c = 3;  // Trailing comment.",
            "  map<string, string> d = 4;",
            "",
            "  oneof choice {",
            "    // A choice.",
            "    string e = 5;",
            "  }",
            "}",
            "enum Kind {",
            "  KIND_UNSPECIFIED = 0;",
            "}",
            "service S {",
            "  //",
            "  rpc Call(Thing) returns (stream Thing);",
            "}",
        ]
    )
    assert uncommented(text) == [
        "line 5: string b = 2;",
        "line 7: map<string, string> d = 4;",
        "line 9: oneof choice {",
        "line 14: enum Kind {",
        "line 15: KIND_UNSPECIFIED = 0;",
        "line 17: service S {",
        "line 19: rpc Call(Thing) returns (stream Thing);",
    ]


def make_kv_handle() -> worker_pb2.KvHandle:
    return worker_pb2.KvHandle(
        version=1,
        handle_id="h-1",
        producer_id="prefill-0",
        producer_incarnation="inc-7",
        producer_address="10.0.0.5:50061",
        request_id="req-42",
        num_tokens=35,
        block_size=16,
        block_ids=[7, 3, 11],
        block_hashes=[bytes(range(16)), bytes(range(16, 32))],
        layout=worker_pb2.KvLayout(
            num_layers=2,
            num_kv_heads=4,
            head_dim=64,
            dtype="bfloat16",
            block_size=16,
            compat_hash=b"\xab" * 16,
        ),
        lease_expires_unix_ms=1_700_000_030_000,
        shm=worker_pb2.ShmTransport(
            segment_name="ps-kv-prefill-0",
            host_id="host-a",
            pool_offset_bytes=4096,
            num_blocks=128,
            block_stride_bytes=65536,
            layer_stride_bytes=32768,
            kv_stride_bytes=16384,
        ),
        grpc=worker_pb2.GrpcTransport(address="10.0.0.5:50061"),
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )


def test_kv_handle_round_trips_through_bytes() -> None:
    handle = make_kv_handle()
    decoded = worker_pb2.KvHandle.FromString(handle.SerializeToString())
    assert decoded == handle
    assert list(decoded.block_ids) == [7, 3, 11]
    assert list(decoded.block_hashes) == [bytes(range(16)), bytes(range(16, 32))]
    assert decoded.layout.compat_hash == b"\xab" * 16
    assert decoded.shm.block_stride_bytes == 65536
    assert decoded.grpc.address == "10.0.0.5:50061"
    assert dict(decoded.trace_context) == dict(handle.trace_context)


def test_generate_request_round_trips_through_bytes() -> None:
    request = generation_pb2.GenerateRequest(
        request_id="req-1",
        token_ids=common_pb2.TokenIds(ids=[1, 15043, 2]),
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=8, stop=["\n\n"], stop_token_ids=[2], logprobs=3
        ),
        priority=-1,
        cache_salt="tenant-a",
        stream=True,
        add_special_tokens=False,
    )
    decoded = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.WhichOneof("prompt") == "token_ids"
    assert list(decoded.token_ids.ids) == [1, 15043, 2]
    assert decoded.sampling.HasField("temperature")
    assert not decoded.sampling.HasField("top_k")
    assert list(decoded.sampling.stop) == ["\n\n"]
    assert decoded.priority == -1
    assert decoded.HasField("add_special_tokens") and not decoded.add_special_tokens


EXPECTED_SERVICES = {
    (generation_pb2, "Generation"): {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
        "GetClusterStatus": ("GetClusterStatusRequest", "ClusterStatus", False),
    },
    (prefill_pb2, "PrefillWorker"): {
        "Prefill": ("PrefillRequest", "PrefillResponse", False),
        "PullKv": ("PullKvRequest", "KvChunk", True),
        "ReleaseKv": ("ReleaseKvRequest", "ReleaseKvResponse", False),
        "Abort": ("pagedserve.v1.AbortRequest", "pagedserve.v1.AbortResponse", False),
        "RenewLease": ("RenewLeaseRequest", "RenewLeaseResponse", False),
        "Warmup": ("WarmupRequest", "WarmupResponse", False),
        "GetLoad": ("GetLoadRequest", "pagedserve.v1.LoadReport", False),
    },
    (decode_pb2, "DecodeWorker"): {
        "Decode": ("DecodeRequest", "DecodeResponse", True),
        # NOTE: an addition to the internal API (docs/architecture.md, "One Deliver stream")
        "Deliver": ("DeliverRequest", "DecodeBatch", True),
        "Abort": ("pagedserve.v1.AbortRequest", "pagedserve.v1.AbortResponse", False),
        "GetLoad": ("GetLoadRequest", "pagedserve.v1.LoadReport", False),
    },
}


@pytest.mark.parametrize(
    ("module", "service_name"), list(EXPECTED_SERVICES), ids=lambda v: getattr(v, "__name__", v)
)
def test_service_has_the_contracted_rpcs(module: object, service_name: str) -> None:
    service = module.DESCRIPTOR.services_by_name[service_name]  # type: ignore[attr-defined]
    own = module.DESCRIPTOR.package + "."  # type: ignore[attr-defined]
    actual = {
        method.name: (
            method.input_type.full_name.removeprefix(own),
            method.output_type.full_name.removeprefix(own),
            method.server_streaming,
        )
        for method in service.methods
        if not method.client_streaming
    }
    assert len(actual) == len(service.methods), "no rpc may be client-streaming"
    assert actual == EXPECTED_SERVICES[(module, service_name)]
