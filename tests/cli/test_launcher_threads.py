"""`pagedserve up` shares the host's cores among its model workers (OMP_NUM_THREADS and a
core-share file, pagedserve/core_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedserve.launcher import _worker_env


def test_workers_share_the_cores_unless_told_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    env, share = _worker_env(None, 2, tmp_path)
    assert env["OMP_NUM_THREADS"] == "8", "each may take every core while the other is idle"
    assert share == tmp_path / "core-share" and share.stat().st_size == 2 * 16, "a slot each"
    env, share = _worker_env(None, 2)
    assert (env["OMP_NUM_THREADS"], share) == ("4", None), "no file: a fixed split"
    assert _worker_env(None, 16)[0]["OMP_NUM_THREADS"] == "1", "never zero threads"
    assert _worker_env(3, 2, tmp_path) == ({**os.environ, "OMP_NUM_THREADS": "3"}, None)
    assert _worker_env(None, 1, tmp_path)[1] is None, "one worker: nothing to share"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert _worker_env(None, 2, tmp_path) == (None, None), "an OMP_NUM_THREADS set is inherited"
    assert _worker_env(2, 2, tmp_path)[0]["OMP_NUM_THREADS"] == "2", "--worker-threads wins"


def test_torch_in_a_worker_process_takes_the_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env, _ = _worker_env(1, 2)
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "1"
