"""Generate the protobuf code that the `pagedserve-client` distribution ships (clients/python/;
the second half of `make protos`).

Compiles `pagedserve/v1/common.proto` and `generation.proto` (the public API; root `protos/`)
and the client's own `pagedserve_client/rpc/status.proto` (root `clients/python/protos/`), then
rewrites the generated `from pagedserve.v1 import` lines to `from pagedserve_client.v1 import`,
so that the client needs no `pagedserve` package. Output: `clients/python/pagedserve_client/v1/`
and `.../rpc/`, or the same layout under `--out DIR` (what the staleness test compares).

It must run under grpcio-tools GRPCIO_TOOLS (the `make client-protoc` venv): its protoc writes
protobuf 4.25 gencode, which every protobuf runtime from 4.25.1 to 7.x loads, where gencode of a
newer protoc refuses runtimes older than itself (docs/clients.md, "Python").

Usage: .cache/client-protoc-venv/bin/python scripts/gen_client_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API_ROOT = ROOT / "protos"
CLIENT_ROOT = ROOT / "clients" / "python"
GRPCIO_TOOLS = "1.62.3"
# (proto root, .proto, generated files kept, package directory under the output root)
SOURCES = (
    (API_ROOT, "pagedserve/v1/common.proto", ("common_pb2.py", "common_pb2.pyi"), "v1"),
    (
        API_ROOT,
        "pagedserve/v1/generation.proto",
        ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"),
        "v1",
    ),
    (
        CLIENT_ROOT / "protos",
        "pagedserve_client/rpc/status.proto",
        ("status_pb2.py", "status_pb2.pyi"),
        "rpc",
    ),
)


def rewrite(text: str) -> str:
    """The generated code with the API's package path moved under pagedserve_client."""
    return text.replace("from pagedserve.v1 import", "from pagedserve_client.v1 import")


def generate(out: Path) -> list[Path]:
    """Write the generated files under `out/pagedserve_client/{v1,rpc}/`; returns them.
    RuntimeError when protoc fails or the grpcio-tools version is not GRPCIO_TOOLS."""
    version = metadata.version("grpcio-tools")
    if version != GRPCIO_TOOLS:
        raise RuntimeError(f"grpcio-tools {version}: the client's code needs {GRPCIO_TOOLS}")
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for root, proto, keep, package in SOURCES:
            args = [
                "grpc_tools.protoc",
                f"--proto_path={root}",
                f"--proto_path={well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                proto,
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed: {' '.join(args)}")
            target = out / "pagedserve_client" / package
            target.mkdir(parents=True, exist_ok=True)
            for name in keep:
                generated = Path(tmp) / Path(proto).parent / name
                (target / name).write_text(rewrite(generated.read_text()))
                written.append(target / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=CLIENT_ROOT, help="output root (default: clients/python/)"
    )
    args = parser.parse_args(argv)
    try:
        written = generate(args.out.resolve())
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
