"""Flags of `pagedserve decode` (a light module: building the parser imports no torch)."""

from __future__ import annotations

import argparse

from pagedserve.config import add_model_arguments, add_server_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_server_arguments(parser, default_port=50071)
    parser.add_argument(
        "--swap-space", type=float, default=4.0, help="GiB of host memory for preempted KV"
    )
    parser.add_argument(
        "--preemption-mode", default="auto", choices=["auto", "swap", "recompute"],
        help="auto: per victim, swap when it fits and is estimated cheaper than recompute",
    )  # fmt: skip
    parser.add_argument(
        "--scheduling-policy", default="priority", choices=["fcfs", "priority"],
        help="priority: lower WorkerRequest.priority runs sooner and is preempted later",
    )  # fmt: skip
    parser.add_argument(
        "--kv-policy", default="paged", choices=["paged", "reserve-max"],
        help="reserve-max: hold prompt + max_tokens slots from admission (a baseline for "
        "benchmarks; paged allocates blocks as tokens arrive)",
    )  # fmt: skip
    parser.add_argument(
        "--import-threads", type=int, default=4, help="threads pulling KV from prefill workers"
    )
