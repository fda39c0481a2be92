"""Flags of `pagedserve prefill` (a light module: building the parser imports no torch)."""

from __future__ import annotations

import argparse

from pagedserve.cli_options import add_model_arguments, add_server_arguments
from pagedserve.kvstore.eviction import add_eviction_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_server_arguments(parser, default_port=50061)
    add_eviction_argument(parser)
    parser.add_argument(
        "--kv-lease-seconds", type=float, default=30.0, help="lease on handed-out KV blocks"
    )
    parser.add_argument("--no-shm", action="store_true", help="do not offer the shm transport")
    parser.add_argument(
        "--warmup-prompts", default=None, metavar="FILE",
        help="prompts to prefill into the prefix cache before READY: a text file, one prompt a "
        "line (tokenized with the model's tokenizer), or a .json list of strings and/or "
        "token-id lists (docs/prefill.md)",
    )  # fmt: skip
    parser.add_argument(
        "--heartbeat-interval", type=float, default=None, metavar="SECONDS",
        help="Redis heartbeat period (default: a third of the worker record's TTL)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-ttl", type=float, default=9.0, metavar="SECONDS",
        help="life of the worker's Redis record without a heartbeat",
    )  # fmt: skip
