"""Generate the Python code of the pagedserve protos (the command behind `make protos`).

Compiles every `.proto` of the public API (`protos/pagedserve/v1/`, Python `pagedserve.v1`) and
of the internal worker APIs (`protos/pagedserve/internal/v1/`, Python `pagedserve.internal.v1`)
with grpc_tools' bundled protoc, proto root `protos/`, into `*_pb2.py`, `*_pb2_grpc.py` and
`*_pb2.pyi`. The output goes next to the protos by default, or under `--out DIR` with the same
relative layout (`DIR/pagedserve/v1/...`, `DIR/pagedserve/internal/v1/...`), which is what the
staleness test compares against the committed files.

Usage: python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
# The public API, then the internal worker APIs (which import the public common.proto).
PACKAGE_DIRS = (Path("pagedserve") / "v1", Path("pagedserve") / "internal" / "v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    """The .proto files to compile, sorted per package, as absolute paths under PROTO_ROOT."""
    return [
        path for package in PACKAGE_DIRS for path in sorted((PROTO_ROOT / package).glob("*.proto"))
    ]


def generated_files(directory: Path) -> list[Path]:
    """The generated files present in `directory`, sorted."""
    return sorted(path for path in directory.iterdir() if path.name.endswith(GENERATED_SUFFIXES))


def generate(out: Path) -> list[Path]:
    """Write the generated code under `out/<package dir>/` for each of PACKAGE_DIRS, replacing
    older generated files. Returns the files written. Raises RuntimeError if protoc reports an
    error.
    """
    protos = proto_files()
    for package in PACKAGE_DIRS:
        if not list((PROTO_ROOT / package).glob("*.proto")):
            raise RuntimeError(f"no .proto files under {PROTO_ROOT / package}")
        target = out / package
        target.mkdir(parents=True, exist_ok=True)
        # NOTE: outputs of a removed .proto would otherwise linger and still import.
        for stale in generated_files(target):
            stale.unlink()
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(path) for path in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [path for package in PACKAGE_DIRS for path in generated_files(out / package)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_ROOT,
        help="output root; files land in OUT/pagedserve/{v1,internal/v1}/ (default: protos/)",
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
