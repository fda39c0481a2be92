"""`pagedserve up`: a whole cluster on one machine as child processes; this module builds their
command lines and starts them in order, supervisor.py keeps them running.

    redis-server (private, free port; skipped with --redis-url, or when no binary exists)
    N x `pagedserve prefill`   M x `pagedserve decode`   1 x `pagedserve router`

Each child prints `READY <id> <address>` when it serves; the launcher waits for all of them, then
for the router's readiness (health of `pagedserve.v1.Generation`), prints the endpoints and
waits. Ctrl-C / SIGTERM stops the router first (it drains), then the workers, then Redis, and
kills whatever has not exited in time; during start-up it stops the children started so far
(each exits as soon as its model is loaded) without waiting for the others to be ready.
Children are tied to the launcher's life (PR_SET_PDEATHSIG, supervisor.py), so even a killed
launcher leaves no process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import core_share
from pagedserve.cli_options import (
    add_kv_cache_dtype_argument,
    add_metrics_names_argument,
    add_quantization_arguments,
    add_tensor_parallel_argument,
    add_tls_arguments,
    check_quantization,
    parse_bytes,
)
from pagedserve.decode_worker.cli_args import (
    DEFAULT_MAX_SWAP_GIB,
    add_speculative_arguments,
    speculative_flags,
)
from pagedserve.grpcutil import ClientTLS, client_tls_from_args, make_channel
from pagedserve.kvstore.disk_tier import check_disk_config
from pagedserve.kvstore.eviction import DEFAULT_EVICTION_POLICY, EvictionPolicy
from pagedserve.logs import add_logging_arguments
from pagedserve.router.chat import read_template_file
from pagedserve.router.routing import DEFAULT_LOCAL_PREFILL
from pagedserve.signals import stop_on_signals
from pagedserve.supervisor import (
    DEFAULT_POLICY,
    Child,
    Cluster,
    CrashLoop,
    RestartPolicy,
    StartFailed,
    StartInterrupted,
    Supervisor,
    await_ready,
    remove_segments,
    spawn,
)

GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_metrics(argv: list[str], args: argparse.Namespace) -> list[str]:
    """Give the child a free `--metrics-port` when `--metrics` is on."""
    if not getattr(args, "metrics", False):
        return argv
    return [*argv, "--metrics-port", str(free_port())]


def _start_redis(log_dir: Path) -> Child | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    child = spawn(
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
    raise StartFailed("redis", f"no answer on 127.0.0.1:{port} after 10 s", "", child.log_path)


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
    common = _common_flags(args)
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
    env, share = _worker_env(getattr(args, "worker_threads", None), len(workers), log_dir)
    for slot, (name, role) in enumerate(workers):
        # NOTE: --port 0, then its port pinned once READY (below): a restarted worker comes
        # back at the same address, so the router's static list and its open channel find it
        # again. A port picked here and bound later could be taken in between (a sibling's
        # outgoing connection took one once).
        argv = [*cli, role, *common, "--port", "0", "--worker-id", name, *redis_args]
        if share is not None:
            argv += ["--core-share", f"{share}:{slot}"]
        print(f"  {name:<10} memory: {memory_plan(role, args, name)}", flush=True)
        started.append(
            spawn(name, _with_metrics(argv + _worker_flags(role, args, name), args), log_dir, env)
        )
    cluster.children[:0] = started  # NOTE: before waiting, so that a failed start stops them
    for child in started:  # NOTE: they load the model in parallel; wait for each in turn
        await_ready(child, args.start_timeout, stop)
        child.pin_port()
    router_argv = [*cli, "router", *common, *redis_args, *_router_flags(args, started)]
    router = spawn("router", _with_metrics(router_argv, args), log_dir)
    cluster.children.insert(0, router)
    await_ready(router, args.start_timeout, stop)
    cluster.router_address = router.address
    router.pin_port()
    try:
        wait_healthy(
            router.address, "pagedserve.v1.Generation", args.start_timeout,
            client_tls_from_args(args),
        )  # fmt: skip
    except RuntimeError as exc:
        raise StartFailed("router", "not healthy", str(exc), router.log_path) from None
    if getattr(args, "http_port", None) is not None:
        _start_gateway(args, log_dir, cluster, stop)


def _common_flags(args: argparse.Namespace) -> list[str]:
    """Flags the router and every worker take alike (the model, what enters block hashes)."""
    common = ["--model", args.model, "--block-size", str(args.block_size)]
    if getattr(args, "served_model_name", None):
        common += ["--served-model-name", args.served_model_name]
    if args.dtype:
        common += ["--dtype", args.dtype]
    if getattr(args, "quantization", None):
        common += ["--quantization", args.quantization,
                   "--quantization-group-size", str(args.quantization_group_size)]  # fmt: skip
        if getattr(args, "quantize_lm_head", False):
            common.append("--quantize-lm-head")
    if getattr(args, "max_model_len", None):
        common += ["--max-model-len", str(args.max_model_len)]
    common += _otlp_flags(args)
    return common + _metrics_names_flags(args) + _tls_flags(args) + _log_flags(args)


def _otlp_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    if getattr(args, "otlp_traces_endpoint", None):
        flags += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if getattr(args, "otlp_traces_protocol", None):
        flags += ["--otlp-traces-protocol", args.otlp_traces_protocol]
    return flags


def _metrics_names_flags(args: argparse.Namespace) -> list[str]:
    naming = getattr(args, "metrics_names", "pagedserve")
    return [] if naming == "pagedserve" else ["--metrics-names", naming]


def _log_flags(args: argparse.Namespace) -> list[str]:
    """`--log-level` and `--log-format`, the same for every child (Redis aside)."""
    flags = []
    for name in ("log_level", "log_format"):
        if getattr(args, name, None):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    return flags


def _start_gateway(
    args: argparse.Namespace, log_dir: Path, cluster: Cluster, stop: threading.Event | None
) -> None:
    """The OpenAI-compatible HTTP gateway in front of the router (HTTPS with the cluster's
    certificate when it has one)."""
    argv = [sys.executable, "-m", "pagedserve.cli", "gateway", "--router", cluster.router_address,
            "--host", args.host, "--port", str(args.http_port)]  # fmt: skip
    argv += _otlp_flags(args) + _metrics_names_flags(args) + _log_flags(args)
    if getattr(args, "tls_cert", None):
        argv += ["--https-cert", args.tls_cert, "--https-key", args.tls_key]
    for name in ("tls_ca", "tls_client_cert", "tls_client_key", "tls_server_name"):
        if getattr(args, name, None):
            argv += [f"--{name.replace('_', '-')}", getattr(args, name)]
    gateway = spawn("gateway", argv, log_dir)
    cluster.children.insert(0, gateway)
    await_ready(gateway, args.start_timeout, stop)
    cluster.http_url = gateway.address
    gateway.pin_port()


def _router_flags(args: argparse.Namespace, workers: list[Child]) -> list[str]:
    """The router's own flags: where it listens, what it passes through, its workers."""
    flags = ["--host", args.host, "--port", str(args.port)]
    if getattr(args, "api_key_file", None):
        flags += ["--api-key-file", args.api_key_file]
    flags += ["--generation-config", getattr(args, "generation_config", "auto")]
    if getattr(args, "chat_template", None):
        flags += ["--chat-template", str(Path(args.chat_template).resolve())]
    passed = ("max_queued_requests", "stream_interval", "stall_timeout", "max_n",
              "max_local_prefill_tokens", "local_prefill_queue_tokens",
              "max_local_suffix_tokens", "tool_call_parser")  # fmt: skip
    for name in passed:
        if getattr(args, name, None) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if getattr(args, "decode_delivery", None) is False:
        flags.append("--no-decode-delivery")
    for child in workers:
        flags += [f"--{child.name.split('-')[0]}", child.address]
    return flags


def _worker_flags(role: str, args: argparse.Namespace, name: str | None = None) -> list[str]:
    """Flags of `up` that a prefill or decode worker (`name`, e.g. prefill-0) takes (its KV
    memory, its disk tier's directory, its eviction, its tensor-parallel ranks)."""
    flags = _memory_flags(role, args)
    disk_dir = worker_disk_dir(args, name or role)
    if disk_dir is not None:
        flags += ["--kv-offload-dir", disk_dir, "--kv-offload-disk", str(args.kv_offload_disk)]
    if getattr(args, "device", "cpu") != "cpu":
        flags += ["--device", args.device]
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if getattr(args, "tensor_parallel_size", 1) != 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if getattr(args, "eviction_policy", None):
        flags += ["--eviction-policy", args.eviction_policy]
    if role == "decode":
        flags += speculative_flags(args)
    return flags


def kv_cache_memory(role: str, args: argparse.Namespace) -> str:
    """A worker's `--kv-cache-memory`: `--prefill-kv-cache-memory` for prefill workers when
    given, else the common one."""
    own = getattr(args, "prefill_kv_cache_memory", None) if role == "prefill" else None
    return str(own or args.kv_cache_memory)


def _memory_flags(role: str, args: argparse.Namespace) -> list[str]:
    flags = ["--kv-cache-memory", kv_cache_memory(role, args)]
    if parse_bytes(str(getattr(args, "kv_offload_memory", None) or 0)) > 0:
        flags += ["--kv-offload-memory", str(args.kv_offload_memory)]
    if role == "decode" and getattr(args, "swap_space", None) is not None:
        flags += ["--swap-space", str(args.swap_space)]
    return flags


def check_kv_memory_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a KV budget that is not a size above 0 (a worker given
    it would only crash-loop)."""
    for flag in ("kv_cache_memory", "prefill_kv_cache_memory"):
        value, name = getattr(args, flag, None), flag.replace("_", "-")
        if value is None:
            continue
        try:
            size = parse_bytes(str(value))
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        if size <= 0:
            raise ValueError(f"{name}: must be above 0, got {value!r}")


def worker_disk_dir(args: argparse.Namespace, name: str) -> str | None:
    """The disk tier directory of worker `name` (`--kv-offload-dir`/`name`: each worker has
    its own, the same across restarts), or None without the flag."""
    disk_dir = getattr(args, "kv_offload_dir", None)
    return str(Path(disk_dir) / name) if disk_dir else None


def check_disk_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for `up`'s disk tier flags that a worker would refuse."""
    check_disk_config(
        parse_bytes(str(getattr(args, "kv_offload_memory", None) or 0)),
        getattr(args, "tensor_parallel_size", 1),
        getattr(args, "kv_offload_dir", None),
        parse_bytes(str(getattr(args, "kv_offload_disk", None) or 0)),
    )


def memory_plan(role: str, args: argparse.Namespace, name: str | None = None) -> str:
    """What a worker (`name`) will allocate beyond its model weights, as the flags say (one
    line)."""
    kv = parse_bytes(kv_cache_memory(role, args))
    plan = f"KV cache {_mib(kv)}"
    offload = parse_bytes(str(getattr(args, "kv_offload_memory", None) or 0))
    if offload > 0:
        plan += f" + host prefix tier {_mib(offload)} (--kv-offload-memory; RAM on CPU too)"
    disk_dir = worker_disk_dir(args, name or role)
    if disk_dir is not None:
        disk = parse_bytes(str(args.kv_offload_disk))
        plan += f" + disk prefix tier {_mib(disk)} in {disk_dir} (--kv-offload-disk)"
    if role != "decode":
        return plan
    swap_gib = getattr(args, "swap_space", None)
    swap = min(kv, int(DEFAULT_MAX_SWAP_GIB * GIB)) if swap_gib is None else int(swap_gib * GIB)
    return f"{plan} + host swap up to {_mib(swap)} (committed as used; pinned on CUDA)"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _worker_env(
    threads: int | None, num_workers: int, log_dir: Path | None = None
) -> tuple[dict[str, str] | None, Path | None]:
    """Environment of the model workers, and the core-share file they lend cores through.

    NOTE: every worker on one host with torch's default (a thread per core) oversubscribes the
    cores, and OpenMP threads that wait for each other then slow every step several times over.
    An explicit `--worker-threads` wins (fixed), then an `OMP_NUM_THREADS` already set (fixed,
    inherited); otherwise the workers share the host's cores: each takes cores / busy workers
    threads before a step (pagedserve/core_share.py), so a decode worker gets every core while the
    prefill worker has nothing to do. Without a `log_dir` for the file, they split the cores.
    """
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return None, None
    cores = os.cpu_count() or 1
    if threads is None and num_workers > 1 and log_dir is not None:
        share = log_dir / "core-share"
        core_share.create(share, num_workers)
        return {**os.environ, "OMP_NUM_THREADS": str(cores)}, share
    if threads is None:
        threads = max(1, cores // max(num_workers, 1))
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}, None


_TLS_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "tls_client_cert",
              "tls_client_key", "tls_server_name")  # fmt: skip


def _tls_flags(args: argparse.Namespace) -> list[str]:
    """The same TLS files for every service (one host, one cluster certificate)."""
    flags: list[str] = []
    for name in _TLS_FLAGS:
        if getattr(args, name, None):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    return flags


# NOTE: on one host the prefill and decode workers share the same cores, so a hand-off buys
# no parallelism and costs a copy, a second process's step and a core split between them: short
# prompts go to the decode worker (S1 on SmolLM2: 1.15-1.24x the tok/s, 0.57-0.6x the TTFT of
# full disaggregation; docs/architecture.md, "Conditional disaggregation"). The router's own default
# (and the Helm chart's) stays 0: across hosts, the prefill worker is the point.
ONE_HOST_LOCAL_PREFILL_TOKENS = 512


def add_local_prefill_arguments(parser: argparse.ArgumentParser) -> None:
    """`up`'s conditional disaggregation, passed to the router (the bench's cluster peers take
    the same flags and defaults, so that they run what `up` runs)."""
    parser.add_argument(
        "--max-local-prefill-tokens", type=int, default=ONE_HOST_LOCAL_PREFILL_TOKENS,
        help="passed to the router: a prompt of at most this many tokens is computed by the "
        "decode worker (conditional disaggregation, docs/router.md); 0: every prompt on a "
        "prefill worker, as in a multi-host deployment",
    )  # fmt: skip
    parser.add_argument(
        "--local-prefill-queue-tokens", type=int, default=0,
        help="passed to the router: only while the prefill worker has this many prompt tokens "
        "queued (0: always)",
    )  # fmt: skip
    parser.add_argument(
        "--max-local-suffix-tokens", type=int, default=DEFAULT_LOCAL_PREFILL.max_suffix_tokens,
        help="passed to the router: a decode worker holding more of a prompt than the prefill "
        "worker (a conversation's next turn) computes it when at most this many of its tokens "
        "are not cached there (docs/router.md); 0: never",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory, or FILE.gguf")
    parser.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="passed to the router and every worker: the model's name in the APIs (the "
        "gateway's /v1/models, GetModelInfo, a request's `model`) and in Redis keys "
        "(default: the model directory's name)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="the router's port (0: free)")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of a private one")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--device", default="cpu", help="passed to every prefill and decode worker (cpu, cuda)"
    )
    add_quantization_arguments(parser)  # NOTE: passed to the router and every worker
    add_kv_cache_dtype_argument(parser)  # NOTE: passed to every worker
    add_tensor_parallel_argument(parser)  # NOTE: passed to every worker, not the router
    parser.add_argument(
        "--kv-cache-memory", default="256MiB",
        help="per worker (prefill workers: --prefill-kv-cache-memory when given)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-kv-cache-memory", default=None,
        help="per prefill worker, instead of --kv-cache-memory: a decode worker holds every "
        "running sequence and, with the locality rule (docs/router.md), a conversation's "
        "follow-up turns, while a prefill worker holds only prompts until they are handed off; "
        "e.g. --kv-cache-memory 448MiB --prefill-kv-cache-memory 64MiB on one host",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-memory", default="0",
        help="per prefill and decode worker: host memory for the prefix cache's host tier "
        "(e.g. 512MiB; evicted prefix blocks are kept there; docs/kv_tiers.md). Default 0: off",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-dir", default=None, metavar="DIR",
        help="the prefix cache's disk tier, below the host tier: each prefill and decode "
        "worker gets DIR/<its name> (e.g. DIR/prefill-0; kept across restarts). Needs "
        "--kv-offload-memory and --kv-offload-disk. Default: off",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-disk", default="0", help="per worker: bytes of its disk tier (e.g. 10GiB)"
    )
    parser.add_argument(
        "--swap-space", type=float, default=None,
        help="GiB of host swap per decode worker (default: the decode worker's: as large as "
        f"--kv-cache-memory, at most {DEFAULT_MAX_SWAP_GIB:g} GiB)",
    )  # fmt: skip
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="passed to the router and every worker"
    )
    parser.add_argument(
        "--eviction-policy", default=None, choices=[p.value for p in EvictionPolicy],
        help="passed to every prefill and decode worker (default: theirs, "
        f"{DEFAULT_EVICTION_POLICY.value})",
    )  # fmt: skip
    add_speculative_arguments(parser)  # NOTE: passed to every decode worker
    parser.add_argument(
        "--generation-config", default="auto", choices=["auto", "none"],
        help="passed to the router (sampling defaults of generation_config.json)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-threads", type=int, default=None,
        help="fixed torch threads per model worker (default: $OMP_NUM_THREADS, else the "
        "workers share the host's cores: cores / busy workers each, before every step)",
    )  # fmt: skip
    parser.add_argument("--otlp-traces-endpoint", default=None, help="passed to every service")
    parser.add_argument(
        "--otlp-traces-protocol", default=None, choices=("grpc", "http/protobuf"),
        help="passed to every service (default: OTEL_* variables, else grpc)",
    )  # fmt: skip
    parser.add_argument("--metrics", action="store_true", help="give every service a metrics port")
    add_metrics_names_argument(parser)  # NOTE: passed to every service
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument(
        "--max-restarts", type=int, default=DEFAULT_POLICY.max_restarts,
        help="a child that exits is restarted (same port), with exponential back-off; this "
        "many restarts within --restart-window seconds, and one more exit stops `up`",
    )  # fmt: skip
    parser.add_argument("--restart-window", type=float, default=DEFAULT_POLICY.window_s)
    parser.add_argument(
        "--restart-backoff", type=float, default=DEFAULT_POLICY.backoff_s,
        help=f"seconds before the first restart; doubled per restart in the window, at most "
        f"{DEFAULT_POLICY.max_backoff_s:g}",
    )  # fmt: skip
    parser.add_argument("--log-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--api-key-file", default=None, help="passed to the router")
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="passed to the router: a Jinja chat template instead of the model's",
    )  # fmt: skip
    parser.add_argument(
        "--tool-call-parser", default=None,
        choices=["auto", "hermes", "llama3_json", "mistral", "none"],
        help="passed to the router: how the model writes a tool call (default: auto)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queued-requests", type=int, default=None, help="passed to the router"
    )
    parser.add_argument("--stream-interval", type=int, default=None, help="passed to the router")
    parser.add_argument("--max-n", type=int, default=None, help="passed to the router")
    parser.add_argument("--stall-timeout", type=float, default=None, help="passed to the router")
    parser.add_argument(
        "--decode-delivery", action=argparse.BooleanOptionalAction, default=None,
        help="passed to the router (default: on)",
    )  # fmt: skip
    add_local_prefill_arguments(parser)
    parser.add_argument(
        "--http-port", type=int, default=None,
        help="also run the OpenAI-compatible HTTP gateway on this port (0: a free one)",
    )  # fmt: skip
    add_tls_arguments(parser)
    add_logging_arguments(parser)  # NOTE: passed to every child but Redis


def main(args: argparse.Namespace) -> int:
    try:
        check_quantization(args.quantization, args.quantize_lm_head)
        check_disk_flags(args)
        check_kv_memory_flags(args)
        if getattr(args, "chat_template", None):
            read_template_file(args.chat_template)  # NOTE: refused here, not by a crash loop
    except ValueError as err:
        print(f"pagedserve up: error: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    stop_on_signals(stop)
    policy = RestartPolicy(args.max_restarts, args.restart_window, args.restart_backoff)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        cluster = start_cluster(args, log_dir, stop)
    except StartInterrupted:
        print("pagedserve up: stopped during start-up", file=sys.stderr)
        return 0
    except StartFailed as exc:  # NOTE: one line; the child's log has the details
        print(f"pagedserve up: error: {exc.line}", file=sys.stderr)
        return 1
    try:
        for child in cluster.children:
            metrics = f"  metrics :{child.metrics_port}" if child.metrics_port else ""
            print(f"  {child.name:<10} {child.address}{metrics}", flush=True)
        print(f"  logs       {log_dir}", flush=True)
        if cluster.http_url:
            print(f"  OpenAI API {cluster.http_url}/v1", flush=True)
        print(f"READY router {cluster.router_address}", flush=True)
        supervisor = Supervisor(cluster, policy)
        while not stop.wait(0.1):
            supervisor.poll()
        return 0
    except CrashLoop as exc:
        print(f"pagedserve up: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()
        for child in cluster.children:
            remove_segments(child)
