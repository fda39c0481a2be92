"""`reuse_freed_memory`: glibc's malloc keeps freed activation memory for the next step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve import host_memory


def test_it_applies_once_and_imports_no_torch():
    """It must run before torch is imported (`pagedserve prefill|decode` call it first)."""
    code = (
        "import sys\n"
        "from pagedserve.host_memory import reuse_freed_memory\n"
        "print(reuse_freed_memory(), reuse_freed_memory(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    applied = "True" if sys.platform == "linux" else "False"
    assert out.stdout.split() == [applied, applied, "False"]


def test_the_workers_cli_applies_it_before_importing_the_server(monkeypatch):
    from pagedserve import cli

    calls: list[str] = []
    monkeypatch.setattr(host_memory, "reuse_freed_memory", lambda: calls.append("mallopt"))
    monkeypatch.setitem(sys.modules, "pagedserve.decode_worker.server", None)
    with pytest.raises(ImportError):
        cli._run_decode(None)  # NOTE: the server import fails after the call
    assert calls == ["mallopt"]
