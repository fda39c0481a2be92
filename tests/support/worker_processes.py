"""Real worker processes for tests: `pagedserve <role> --port 0 ...` until its READY line."""

from __future__ import annotations

import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 60.0


@dataclass
class WorkerProcess:
    """A `pagedserve <role>` process that printed `READY <worker_id> <address>`."""

    proc: subprocess.Popen[str]
    log_path: Path
    worker_id: str = ""
    address: str = ""

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn(role: str, args: list[str], log_path: Path) -> WorkerProcess:
    """Start `pagedserve <role> ...` (not waiting for it: see `wait_ready`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", role, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=log_path.open("w"),
        text=True,
    )
    return WorkerProcess(proc, log_path)


def wait_ready(worker: WorkerProcess, timeout_s: float = START_TIMEOUT_S) -> WorkerProcess:
    """Block until the READY line (bounded); fail the test with the log otherwise."""
    assert worker.proc.stdout is not None
    ready, _, _ = select.select([worker.proc.stdout], [], [], timeout_s)
    line = worker.proc.stdout.readline() if ready else ""
    if not line.startswith("READY"):
        worker.stop()
        pytest.fail(f"worker did not start: {worker.log_tail()}")
    _, worker.worker_id, worker.address = line.split()
    return worker
