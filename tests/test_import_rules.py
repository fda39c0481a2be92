"""DESIGN §2: schedulers, step plans and `Sequence` import no torch (each module checked in a
fresh interpreter, so nothing imported by another test hides a violation)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = (
    "pagedserve.model.batch",
    "pagedserve.model.sequence",
    "pagedserve.model.progress",
    "pagedserve.decode_worker.scheduler",
    "pagedserve.decode_worker.plan",
    "pagedserve.decode_worker.preemption",
    "pagedserve.prefill_worker.scheduler",
    "pagedserve.gateway.server",  # the gateway: a client of the public API, torch-free
    "pagedserve.gateway.app",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"{module} imports torch"
