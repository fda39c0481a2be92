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
    add_speculative_arguments(parser)


SPECULATIVE_FLAGS = (
    "speculative_method", "num_speculative_tokens", "speculative_ngram_min",
    "speculative_ngram_max", "speculative_max_batch", "speculative_model",
)  # fmt: skip


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (the decode worker's, and `up`'s, which passes them on)."""
    parser.add_argument(
        "--speculative-method", default=None, choices=["ngram", "draft"],
        help="speculative decoding: ngram proposes the tokens that followed the latest earlier "
        "occurrence of the sequence's last tokens (prompt lookup); draft, those a smaller "
        "model of the same vocabulary (--speculative-model) predicts (docs/speculative.md). "
        "Default: off",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-model", default=None,
        help="the draft model's directory, for --speculative-method draft (its KV takes a "
        "share of --kv-cache-memory: every block holds the target's and the draft's)",
    )  # fmt: skip
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=4,
        help="the most tokens proposed per sequence and step (k); each sequence's k adapts "
        "to how many of its proposals are accepted",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-ngram-min", type=int, default=1,
        help="the shortest suffix the n-gram lookup matches",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-ngram-max", type=int, default=4,
        help="the longest suffix the n-gram lookup matches (tried first)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-max-batch", type=int, default=8,
        help="no proposals while more sequences than this run (verification then costs "
        "compute a batch's weight reads no longer hide)",
    )  # fmt: skip


def speculative_flags(args: argparse.Namespace) -> list[str]:
    """The speculative flags of `args` as a decode worker's command line (none when off)."""
    if getattr(args, "speculative_method", None) is None:
        return []
    flags = []
    for name in SPECULATIVE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags
