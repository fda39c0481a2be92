"""Check the import rules (docs/architecture.md) with import-linter (`lint-imports`, `make lint`).

The contracts live in pyproject.toml (`[tool.importlinter]`). The sub-packages live in top-level
folders; the committed symlinks `pagedserve/<sub-package>` -> `../<folder>` lay them out
under `pagedserve/` on disk, where import-linter (which walks the package's directory) finds them,
so a plain `lint-imports` at the repository root checks the same contracts as this script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    linter = Path(sys.executable).with_name("lint-imports")
    return subprocess.call([str(linter)], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
