"""Real worker processes and what the tests read from them: `pagedserve <role>` until its
READY line, device blocks in use (GetLoad) and the Prometheus counters of `--metrics-port`."""

from __future__ import annotations

import select
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc

from pagedserve.internal.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from support.probes import samples

START_TIMEOUT_S = 90.0


@dataclass
class Process:
    """A `pagedserve <role>` process that printed `READY <worker_id> <address>`."""

    role: str
    proc: subprocess.Popen[str]
    log_path: Path
    worker_id: str = ""
    address: str = ""
    metrics_port: int | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (drain), then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL (no drain), and wait for it to go (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def used_blocks(self) -> int:
        """Device blocks neither free nor cached (leased, filling, running)."""
        with grpc.insecure_channel(self.address) as channel:
            stub = (
                prefill_pb2_grpc.PrefillWorkerStub(channel)
                if self.role == "prefill"
                else decode_pb2_grpc.DecodeWorkerStub(channel)
            )
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        return load.kv_blocks_total - load.kv_blocks_free - load.kv_blocks_cached

    def metric(self, name: str) -> float:
        """One sample of `pagedserve:{name}` from the process's /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return samples(response.read().decode())[f"pagedserve:{name}"]


def start(role: str, args: list[str], log_path: Path, *, metrics_port: int | None = None):
    """Spawn `pagedserve <role> --port 0 ...` (wait for it with `wait_ready`)."""
    argv = [sys.executable, "-m", "pagedserve.cli", role, "--port", "0", *args]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    return Process(role, proc, log_path, metrics_port=metrics_port)


def wait_ready(process: Process, timeout_s: float = START_TIMEOUT_S) -> Process:
    """Block until the READY line (bounded); raise with the log's tail otherwise."""
    assert process.proc.stdout is not None
    ready, _, _ = select.select([process.proc.stdout], [], [], timeout_s)
    line = process.proc.stdout.readline() if ready else ""
    if not line.startswith("READY"):
        process.stop()
        raise RuntimeError(f"{process.role} did not start: {process.log_tail()}")
    _, process.worker_id, process.address = line.split()[:3]
    return process
