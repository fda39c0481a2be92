"""`pagedserve up` splits the host's cores among its model workers (OMP_NUM_THREADS)."""

from __future__ import annotations

import subprocess
import sys

from pagedserve.launcher import _worker_env


def test_workers_split_the_cores_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert _worker_env(None, 2)["OMP_NUM_THREADS"] == "4"
    assert _worker_env(None, 16)["OMP_NUM_THREADS"] == "1", "never zero threads"
    assert _worker_env(3, 2)["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert _worker_env(None, 2) is None, "an OMP_NUM_THREADS already set is inherited"
    assert _worker_env(2, 2)["OMP_NUM_THREADS"] == "2", "--worker-threads wins"


def test_torch_in_a_worker_process_takes_the_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = _worker_env(1, 2)
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "1"
