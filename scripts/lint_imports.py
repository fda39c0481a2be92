"""Check DESIGN §2's import rules with import-linter (`lint-imports`).

The contracts live in pyproject.toml (`[tool.importlinter]`). import-linter finds packages on
disk from `sys.path`, and our sub-packages live in top-level folders that only the editable
install's import hook maps under `pagedserve` (DESIGN §2); so, like `typecheck.py`, this lays the
import tree out as symlinks under .cache/typecheck/ and runs the linter over that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typecheck import ROOT, TREE, build_tree


def main() -> int:
    build_tree()
    linter = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(TREE)}
    return subprocess.call([str(linter), str(ROOT / "pyproject.toml")], cwd=TREE, env=env)


if __name__ == "__main__":
    sys.exit(main())
