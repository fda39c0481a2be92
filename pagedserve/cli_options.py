"""Argparse helpers shared by every service's command line (flags named like vLLM's): flag
groups, argument types, byte sizes."""

from __future__ import annotations

import argparse
import re
import socket

from pagedserve.logs import add_logging_arguments

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_UNITS |= {"ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bytes(text: str) -> int:
    """`"512MiB"`, `"2G"`, `"1.5gib"` or a plain byte count -> bytes. ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise ValueError(f"size: {text!r} is not a byte count like 512MiB or 2GB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit or ""])


def bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def default_worker_id(role: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{port}"


QUANTIZATION_METHODS = ("int8", "int4", "w8a8")
QUANTIZATION_GROUP_SIZES = (32, 64, 128, 256)


def quantization_name(method: str | None, group_size: int = 32) -> str:
    """How quantized weights are named in block-hash fingerprints, logs and reports: "" (the
    model's dtype), "int8", "w8a8", "int4-g128". The router and every worker compute it from the
    same flags, so their block hashes and compat tags agree."""
    if method in (None, "", "none"):
        return ""
    return f"int4-g{group_size}" if method == "int4" else method


def check_quantization(method: str | None, lm_head: bool) -> None:
    """ValueError naming `quantize_lm_head` when it comes without a quantization method: a
    flag that would change nothing is refused, not ignored (every command that takes it)."""
    if lm_head and method in (None, "", "none"):
        raise ValueError("quantize_lm_head: needs --quantization int8, int4 or w8a8")


def add_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization", default=None, choices=["none", *QUANTIZATION_METHODS],
        help="quantization of the linear layers, at load (docs/quantization.md): int8 per "
        "output channel, int4 per group of --quantization-group-size inputs (weight-only); w8a8: "
        "int8 weights per channel and activations quantized to int8 per token at run time, "
        "int8 products on AMX / VNNI (CPU, float32 only; not equal to the unquantized model's "
        "arithmetic, see its accuracy in the docs); part of "
        "the block hashes, so the router and every worker must agree",
    )  # fmt: skip
    parser.add_argument(
        "--quantization-group-size", type=int, default=32, choices=QUANTIZATION_GROUP_SIZES,
        help="int4: input features per (scale, zero) pair",
    )  # fmt: skip
    parser.add_argument(
        "--quantize-lm-head", action="store_true",
        help="with --quantization: the LM head's weight in int8 per output channel too (a tied "
        "head gets its own int8 copy; the embedding stays), as llama.cpp's Q8_0 files hold "
        "their output tensor; every step reads the head whole, so this is a quarter of its "
        "bytes. Not part of the block hashes (the head makes no KV)",
    )  # fmt: skip


KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8")


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto (the model's dtype), or 8-bit codes with a float32 "
        "scale per block, layer and KV head: int8, fp8_e4m3 (fp8 is e4m3); about half the bytes "
        "of bf16 per token (docs/quantization.md). Blocks move only between workers that agree",
    )  # fmt: skip


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=positive_int,
        default=1, metavar="N",
        help="rank processes that each hold a shard of the weights and KV heads (Megatron-style; "
        "gloo on CPU); must divide the attention heads, MLP features and vocabulary; prefill "
        "and decode workers must use the same size to hand KV off",
    )  # fmt: skip


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every model-running worker shares."""
    parser.add_argument(
        "--model", required=True, help="local Hugging Face model directory, or FILE.gguf"
    )
    parser.add_argument("--served-model-name", default=None, help="name in Redis keys and APIs")
    parser.add_argument("--revision", default="", help="weights revision, part of block hashes")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_quantization_arguments(parser)
    add_kv_cache_dtype_argument(parser)
    add_tensor_parallel_argument(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)
    parser.add_argument(
        "--max-model-len", type=positive_int, default=None,
        help="longest prompt + output in tokens (default: max_position_embeddings)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-memory", type=bytes_arg, default=parse_bytes("256MiB"),
        help="bytes of KV cache (e.g. 2GiB); ignored with --num-gpu-blocks-override",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-memory-fraction", type=fraction, default=None,
        help="size the KV cache as this fraction of the device's memory (the container's "
        "memory limit or RAM on CPU) minus the model's weights, e.g. 0.9 on a GPU (vLLM's "
        "--gpu-memory-utilization); replaces --kv-cache-memory",
    )  # fmt: skip
    parser.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
    parser.add_argument(
        "--kv-offload-memory", type=bytes_arg, default=0,
        help="bytes of host memory for the prefix cache's host tier (e.g. 1GiB): evicted "
        "cached blocks are copied there and promoted back on a later prefix hit, no recompute "
        "(docs/kv_tiers.md). Default 0: off",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-dir", default=None, metavar="DIR",
        help="a directory for the prefix cache's disk tier, below the host tier: blocks the "
        "host tier evicts are written there and promoted back on a later prefix hit; they "
        "survive a restart with the same configuration. Needs --kv-offload-memory and "
        "--kv-offload-disk; one directory per worker (docs/kv_tiers.md). Default: off",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-disk", type=bytes_arg, default=0,
        help="bytes of disk for the disk tier (e.g. 10GiB; with --kv-offload-dir)",
    )  # fmt: skip
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--core-share", default=None, metavar="PATH:SLOT",
        help="share this host's cores with the other workers of one `pagedserve up` through "
        "the file PATH (this worker's slot SLOT): a worker takes cores / busy workers threads "
        "before each step (set by `pagedserve up`; docs/architecture.md)",
    )  # fmt: skip


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in pods)")
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--advertise-address", default=None, help="host:port others dial")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--redis-url", default=None, help="redis://host:port/0 (optional)")
    add_serving_arguments(parser)
    parser.add_argument(
        "--trace-include-text", action="store_true", help="put prompt/output text in spans"
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics")
    add_metrics_names_argument(parser)
    parser.add_argument(
        "--health-port", type=int, default=None,
        help="also serve grpc.health.v1.Health alone, in plaintext, on this port of --host "
        "(for probes that cannot speak TLS, e.g. kubelet's gRPC probes; no other service)",
    )  # fmt: skip

    add_tls_arguments(parser)


def add_metrics_names_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-names", default="pagedserve", choices=("pagedserve", "vllm"),
        help="the names of the Prometheus series: pagedserve's (`pagedserve:*`), or vLLM's "
        "(`vllm:*`, for dashboards and autoscalers written for vLLM; docs/metrics.md)",
    )  # fmt: skip


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """What every server takes, the HTTP gateway included: message size, drain, traces, logs."""
    parser.add_argument("--max-message-bytes", type=bytes_arg, default=parse_bytes("64MiB"))
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds")
    parser.add_argument(
        "--otlp-traces-endpoint", default=None,
        help="OTLP collector, e.g. http://jaeger:4317 (default: OTEL_* variables, else off)",
    )  # fmt: skip
    parser.add_argument(
        "--otlp-traces-protocol", default=None, choices=("grpc", "http/protobuf"),
        help="how spans reach the collector: OTLP over gRPC (port 4317) or HTTP (4318; "
        "default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)",
    )  # fmt: skip
    add_logging_arguments(parser)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """Transport security: this server's certificate, and what its outgoing channels use."""
    group = parser.add_argument_group("TLS (PEM files; default: plaintext on loopback)")
    group.add_argument("--tls-cert", default=None, help="this server's certificate chain")
    group.add_argument("--tls-key", default=None, help="this server's private key")
    group.add_argument(
        "--tls-client-ca", default=None,
        help="require client certificates signed by this CA (mTLS)",
    )  # fmt: skip
    add_client_tls_arguments(group)


def add_client_tls_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """What outgoing channels use (`grpcutil.client_tls_from_args`): servers, the launcher and
    the client commands (`pagedserve generate --router`, `pagedserve status`) share them."""
    parser.add_argument(
        "--tls-ca", default=None, help="CA that outgoing channels trust (turns TLS on for them)"
    )
    parser.add_argument(
        "--tls-client-cert", default=None, help="certificate outgoing channels show"
    )
    parser.add_argument("--tls-client-key", default=None, help="its private key")
    parser.add_argument(
        "--tls-server-name", default=None, help="name to check in servers' certificates"
    )
