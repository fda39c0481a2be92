"""architecture.md: schedulers, step plans and `Sequence` import no torch (each module checked in a
fresh interpreter, so nothing imported by another test hides a violation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TORCH_FREE = (
    "pagedserve.model.requests.batch",
    "pagedserve.model.requests.sequence",
    "pagedserve.model.requests.progress",
    "pagedserve.model.requests.beam_search",
    "pagedserve.model.requests.convert",
    "pagedserve.decode_worker.scheduler",
    "pagedserve.decode_worker.plan",
    "pagedserve.decode_worker.preemption",
    "pagedserve.prefill_worker.scheduler",
    "pagedserve.gateway.server",  # the gateway: a client of the public API, torch-free
    "pagedserve.gateway.app",
    "pagedserve.core_share",  # the launcher creates the core-share file without torch
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"{module} imports torch"


CHECKOUT = Path(__file__).resolve().parents[1]
WHERE_KERNELS = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"


def _run_in_checkout(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
        cwd=CHECKOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_checkout_root_never_hides_a_package_once_pagedserve_is_imported() -> None:
    """`kernels/` is `pagedserve.kernels`, never the `kernels` that transformers imports
    (Hugging Face's; a dependency of transformers >= 5.25), even in a process started in the
    checkout, as `pagedserve up` starts its workers."""
    ours = str(CHECKOUT / "kernels" / "__init__.py")
    assert _run_in_checkout(WHERE_KERNELS) == ours, "the checkout no longer shadows: test moot"
    assert _run_in_checkout(f"import pagedserve; {WHERE_KERNELS}") != ours
    assert _run_in_checkout("import pagedserve.kernels.reference as r; print(r.__name__)") == (
        "pagedserve.kernels.reference"
    )
