"""`pagedserve up`: a whole cluster on one machine as child processes.

    redis-server (private, free port; skipped with --redis-url, or when no binary exists)
    N x `pagedserve prefill`   M x `pagedserve decode`   1 x `pagedserve router`

Each child prints `READY <id> <address>` when it serves; the launcher waits for all of them, then
for the router's readiness (health of `pagedserve.v1.Generation`), prints the endpoints and
waits. Ctrl-C / SIGTERM stops the router first (it drains), then the workers, then Redis, and
kills whatever has not exited in time; during start-up it stops the children started so far
(each exits as soon as its model is loaded) without waiting for the others to be ready.
Children are tied to the launcher's life (PR_SET_PDEATHSIG), so even a killed launcher leaves no
process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.config import add_tls_arguments, parse_bytes
from pagedserve.decode_worker.cli_args import DEFAULT_MAX_SWAP_GIB
from pagedserve.grpcutil import ClientTLS, client_tls_from_args, make_channel

_PR_SET_PDEATHSIG = 1
GIB = 1 << 30


def _die_with_parent() -> None:  # runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""
    metrics_port: int | None = None


@dataclass(slots=True)
class Cluster:
    children: list[Child] = field(default_factory=list)
    redis_url: str | None = None
    router_address: str = ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """Router first (it drains), then workers, then Redis; kill what lingers."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            if child.name == "router":
                _wait(child.proc, timeout_s)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            _wait(child.proc, max(0.1, deadline - time.monotonic()))


class StartInterrupted(Exception):
    """A stop was requested (SIGTERM / SIGINT) before the cluster was ready."""


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise StartInterrupted("stopped during start-up")


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Child:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads run user code yet
        )
    return Child(name, proc, log_path, metrics_port=_metrics_port(argv))


def _with_metrics(argv: list[str], args: argparse.Namespace) -> list[str]:
    """Give the child a free `--metrics-port` when `--metrics` is on."""
    if not getattr(args, "metrics", False):
        return argv
    return [*argv, "--metrics-port", str(free_port())]


def _metrics_port(argv: list[str]) -> int | None:
    return int(argv[argv.index("--metrics-port") + 1]) if "--metrics-port" in argv else None


def _await_ready(child: Child, timeout_s: float, stop: threading.Event | None = None) -> None:
    """Read the child's stdout until `READY <id> <address>` (in a thread, to bound the wait);
    StartInterrupted as soon as `stop` is set."""
    result: list[str] = []
    stdout = child.proc.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: result.append(stdout.readline()))
    reader.daemon = True
    reader.start()
    deadline = time.monotonic() + timeout_s
    while reader.is_alive() and time.monotonic() < deadline:
        _check_stop(stop)
        reader.join(0.1)
    line = result[0] if result else ""
    if not line.startswith("READY"):
        tail = child.log_path.read_text()[-3000:]
        raise RuntimeError(f"{child.name} did not start (see {child.log_path}):\n{tail}")
    child.address = line.split()[2]


def _start_redis(log_dir: Path) -> Child | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    child = _spawn(
        "redis",
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(log_dir)],
        log_dir,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            child.address = f"127.0.0.1:{port}"
            return child
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def wait_healthy(
    address: str, service: str, timeout_s: float, tls: ClientTLS | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    with make_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                request = health_pb2.HealthCheckRequest(service=service)
                if stub.Check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"{service} at {address} not healthy after {timeout_s}s")


def start_cluster(
    args: argparse.Namespace, log_dir: Path, stop: threading.Event | None = None
) -> Cluster:
    """Start every child and wait until the router is ready. If `stop` is set meanwhile, stop
    the children started so far and raise StartInterrupted."""
    cluster = Cluster()
    try:
        _start_all(args, log_dir, cluster, stop)
    except StartInterrupted:
        cluster.stop()  # NOTE: time to exit cleanly: a killed prefill leaves its shm segment
        raise
    except BaseException:
        cluster.stop(timeout_s=5)
        raise
    return cluster


def _start_all(
    args: argparse.Namespace, log_dir: Path, cluster: Cluster, stop: threading.Event | None
) -> None:
    cli = [sys.executable, "-m", "pagedserve.cli"]
    common = ["--model", args.model, "--block-size", str(args.block_size)]
    if args.dtype:
        common += ["--dtype", args.dtype]
    if getattr(args, "max_model_len", None):
        common += ["--max-model-len", str(args.max_model_len)]
    if getattr(args, "otlp_traces_endpoint", None):
        common += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    common += _tls_flags(args)
    cluster.redis_url = args.redis_url
    if cluster.redis_url is None:
        redis = _start_redis(log_dir)
        if redis is not None:
            cluster.children.append(redis)
            cluster.redis_url = f"redis://{redis.address}/0"
    redis_args = ["--redis-url", cluster.redis_url] if cluster.redis_url else []
    workers = [(f"prefill-{i}", "prefill") for i in range(args.prefill)]
    workers += [(f"decode-{i}", "decode") for i in range(args.decode)]
    started = []
    env = _worker_env(getattr(args, "worker_threads", None), len(workers))
    for name, role in workers:
        argv = [*cli, role, *common, "--port", "0", "--worker-id", name, *redis_args]
        print(f"  {name:<10} memory: {memory_plan(role, args)}", flush=True)
        started.append(
            _spawn(name, _with_metrics(argv + _memory_flags(role, args), args), log_dir, env)
        )
    cluster.children[:0] = started  # NOTE: before waiting, so that a failed start stops them
    for child in started:  # NOTE: they load the model in parallel; wait for each in turn
        _await_ready(child, args.start_timeout, stop)
    router_argv = [*cli, "router", *common, "--host", args.host, "--port", str(args.port)]
    router_argv += redis_args
    if getattr(args, "api_key_file", None):
        router_argv += ["--api-key-file", args.api_key_file]
    router_argv += ["--generation-config", getattr(args, "generation_config", "auto")]
    for child in started:
        router_argv += [f"--{child.name.split('-')[0]}", child.address]
    router = _spawn("router", _with_metrics(router_argv, args), log_dir)
    cluster.children.insert(0, router)
    _await_ready(router, args.start_timeout, stop)
    cluster.router_address = router.address
    wait_healthy(
        router.address, "pagedserve.v1.Generation", args.start_timeout, client_tls_from_args(args)
    )


def _memory_flags(role: str, args: argparse.Namespace) -> list[str]:
    flags = ["--kv-cache-memory", args.kv_cache_memory]
    if role == "decode" and getattr(args, "swap_space", None) is not None:
        flags += ["--swap-space", str(args.swap_space)]
    return flags


def memory_plan(role: str, args: argparse.Namespace) -> str:
    """What a worker will allocate beyond its model weights, as the flags say (one line)."""
    kv = parse_bytes(args.kv_cache_memory)
    plan = f"KV cache {_mib(kv)}"
    if role != "decode":
        return plan
    swap_gib = getattr(args, "swap_space", None)
    swap = min(kv, int(DEFAULT_MAX_SWAP_GIB * GIB)) if swap_gib is None else int(swap_gib * GIB)
    return f"{plan} + host swap up to {_mib(swap)} (committed as used; pinned on CUDA)"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _worker_env(threads: int | None, num_workers: int) -> dict[str, str] | None:
    """Environment of the model workers: their torch threads split the host's cores.

    NOTE: every worker on one host with torch's default (a thread per core) oversubscribes the
    cores, and OpenMP threads that wait for each other then slow every step several times over.
    An explicit `--worker-threads` wins, then an `OMP_NUM_THREADS` already set, then the split.
    """
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return None
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // max(num_workers, 1))
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


_TLS_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tls_client_cert",
              "tls_client_key", "tls_server_name")  # fmt: skip


def _tls_flags(args: argparse.Namespace) -> list[str]:
    """The same TLS files for every service (one host, one cluster certificate)."""
    flags: list[str] = []
    for name in _TLS_FLAGS:
        if getattr(args, name, None):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    return flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory, or FILE.gguf")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="the router's port (0: free)")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of a private one")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per worker")
    parser.add_argument(
        "--swap-space", type=float, default=None,
        help="GiB of host swap per decode worker (default: the decode worker's: as large as "
        f"--kv-cache-memory, at most {DEFAULT_MAX_SWAP_GIB:g} GiB)",
    )  # fmt: skip
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="passed to the router and every worker"
    )
    parser.add_argument(
        "--generation-config", default="auto", choices=["auto", "none"],
        help="passed to the router (sampling defaults of generation_config.json)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-threads", type=int, default=None,
        help="torch threads per model worker (default: $OMP_NUM_THREADS, else the host's cores "
        "divided among the workers)",
    )  # fmt: skip
    parser.add_argument("--otlp-traces-endpoint", default=None, help="passed to every service")
    parser.add_argument("--metrics", action="store_true", help="give every service a metrics port")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--log-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--api-key-file", default=None, help="passed to the router")
    add_tls_arguments(parser)


def main(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        cluster = start_cluster(args, log_dir, stop)
    except StartInterrupted:
        print("pagedserve up: stopped during start-up", file=sys.stderr)
        return 0
    try:
        for child in cluster.children:
            metrics = f"  metrics :{child.metrics_port}" if child.metrics_port else ""
            print(f"  {child.name:<10} {child.address}{metrics}", flush=True)
        print(f"  logs       {log_dir}", flush=True)
        print(f"READY router {cluster.router_address}", flush=True)
        while not stop.wait(0.5):
            dead = [c.name for c in cluster.children if c.proc.poll() is not None]
            if dead:
                print(f"pagedserve up: {', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        cluster.stop()
