"""Fixtures of the Helm chart tests: the tools, fetched once, and the render matrix, rendered
once per session (helpers and constants are in chart.py)."""

from __future__ import annotations

import subprocess

import pytest
from chart import MATRIX, ROOT, Doc, Tools, render


@pytest.fixture(scope="session")
def tools() -> Tools:
    result = subprocess.run(
        [str(ROOT / "scripts" / "get_helm.sh"), "--with-checkov"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    helm4, helm3, checkov = (ROOT / line for line in result.stdout.split())
    return Tools(helm4, helm3, checkov)


@pytest.fixture(scope="session")
def renders(tools: Tools) -> dict[str, list[Doc]]:
    return {name: render(tools.helm4, args) for name, args in MATRIX.items()}
