"""Flags of `pagedserve prefill` (a light module: building the parser imports no torch)."""

from __future__ import annotations

import argparse

from pagedserve.config import add_model_arguments, add_server_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_server_arguments(parser, default_port=50061)
    parser.add_argument(
        "--kv-lease-seconds", type=float, default=30.0, help="lease on handed-out KV blocks"
    )
    parser.add_argument("--no-shm", action="store_true", help="do not offer the shm transport")
