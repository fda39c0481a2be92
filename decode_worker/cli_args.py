"""Flags of `pagedserve decode` (a light module: building the parser imports no torch)."""

from __future__ import annotations

import argparse

from pagedserve.cli_options import add_model_arguments, add_server_arguments
from pagedserve.kvstore.eviction import add_eviction_argument

DEFAULT_MAX_SWAP_GIB = 4.0  # the cap of the default swap space (vLLM's default size)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_server_arguments(parser, default_port=50071)
    add_eviction_argument(parser)
    parser.add_argument(
        "--swap-space", type=float, default=None,
        help="GiB of host memory for preempted KV (default: the size of the device KV pool, "
        f"--kv-cache-memory, at most {DEFAULT_MAX_SWAP_GIB:g} GiB; 0: no swap). Without CUDA "
        "its pages are committed only as blocks are first swapped into; pinned (CUDA) it is "
        "committed at start",
    )  # fmt: skip
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
