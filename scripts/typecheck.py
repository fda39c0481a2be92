"""Run mypy over the `pagedserve` import tree, then over `pagedserve_client` (clients/python/).

The packages live in top-level folders mapped by `[tool.setuptools.package-dir]` (architecture.md),
which mypy cannot follow through the editable install's import hook. This lays the import tree
out as symlinks under .cache/typecheck/ (e.g. pagedserve/kvstore -> ../../../kvstore) and checks
that, so every `from pagedserve.kvstore ...` resolves to the real source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".cache" / "typecheck"


def build_tree() -> Path:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    shutil.rmtree(TREE, ignore_errors=True)
    top = TREE / "pagedserve"
    top.mkdir(parents=True)
    for entry in (ROOT / mapping["pagedserve"]).iterdir():
        if entry.suffix in (".py", ".typed"):
            (top / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        if package != "pagedserve":
            link = TREE / package.replace(".", os.sep)
            # NOTE: pagedserve.internal.v1 is already there through pagedserve.internal's link
            if not link.exists():
                link.symlink_to(ROOT / folder, target_is_directory=True)
    return top


def main() -> int:
    top = build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(top)]
    status = subprocess.call(cmd, cwd=TREE, env={**os.environ, "MYPYPATH": str(TREE)})
    # NOTE: the client distribution (clients/python/) on its own: a plain package, no mapping
    client = [*cmd[:-1], str(ROOT / "clients" / "python" / "pagedserve_client")]
    return status or subprocess.call(client, cwd=ROOT / "clients" / "python")


if __name__ == "__main__":
    sys.exit(main())
