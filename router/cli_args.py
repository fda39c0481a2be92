"""Flags of `pagedserve router` (a light module: building the parser imports nothing heavy)."""

from __future__ import annotations

import argparse

from pagedserve.cli_options import (
    add_quantization_arguments,
    add_server_arguments,
    non_negative_int,
    positive_int,
)
from pagedserve.router.routing import DEFAULT_LOCAL_PREFILL
from pagedserve.sampling_params import DEFAULT_MAX_N

# NOTE: sized by memory (docs/router.md, "Overload"): a request in flight costs the router
# ~70 KiB of RSS (measured: 1,000 streams held queued behind a busy decode worker grew a
# router of 72 MiB by 69 MiB), so 4,096 take ~280 MiB, inside the chart's 512 MiB request
DEFAULT_MAX_QUEUED_REQUESTS = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="model directory (tokenizer + config), or FILE.gguf"
    )
    parser.add_argument("--served-model-name", default=None, help="name in Redis keys and APIs")
    parser.add_argument("--revision", default="", help="must match the workers' --revision")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="the workers' KV dtype (part of block hashes); default: the checkpoint's",
    )  # fmt: skip
    add_quantization_arguments(parser)  # NOTE: the workers' (part of block hashes)
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="the workers' block size"
    )
    parser.add_argument(
        "--max-model-len", type=positive_int, default=None,
        help="the workers' --max-model-len (default: the model's max_position_embeddings)",
    )  # fmt: skip
    parser.add_argument(
        "--generation-config", default="auto", choices=["auto", "none"],
        help="auto: generation_config.json's sampling defaults apply to requests that leave them "
        "unset; none: SamplingParams' own defaults (eos ids are read either way)",
    )  # fmt: skip
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template that renders every conversation (chat requests and Tokenize "
        "with messages) instead of the model's own, or for a model without one; a file that "
        "cannot be read or does not compile stops the router at start",
    )  # fmt: skip
    parser.add_argument(
        "--tool-call-parser", default="auto",
        choices=["auto", "hermes", "llama3_json", "mistral", "none"],
        help="how the model writes a tool call, for the HTTP gateway to parse (ModelInfo."
        "tool_call_parser); auto: detected from the chat template's markers (docs/tools.md)",
    )  # fmt: skip
    add_server_arguments(parser, default_port=50051)
    parser.add_argument("--prefill", action="append", default=[], help="static prefill address")
    parser.add_argument("--decode", action="append", default=[], help="static decode address")
    parser.add_argument(
        "--max-queued-requests", type=positive_int, default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="requests in flight through this router (streaming or waiting); one more is "
        "RESOURCE_EXHAUSTED (with RetryInfo) at once. Default: what the router's memory holds "
        "(~70 KiB each, docs/router.md)",
    )  # fmt: skip
    parser.add_argument(
        "--stream-interval", type=positive_int, default=1,
        help="the least new tokens per streamed message after the first, for requests that "
        "set no stream_interval (vLLM's name); 1: every decode step's tokens at once",
    )  # fmt: skip
    parser.add_argument(
        "--max-n", type=positive_int, default=DEFAULT_MAX_N,
        help="most samples (SamplingParams n, or best_of) per request",
    )  # fmt: skip
    parser.add_argument("--load-poll-interval", type=float, default=0.5, help="seconds")
    parser.add_argument(
        "--route-wait-timeout", type=float, default=5.0,
        help="seconds a request with no ready (prefill, decode) pair waits for one (a worker "
        "restarting) before UNAVAILABLE; never past the request's deadline",
    )  # fmt: skip
    parser.add_argument(
        "--stall-timeout", type=float, default=10.0,
        help="seconds without a message from a stream's decode worker, while that worker also "
        "fails its load polls, before the stream moves to another pair (a live worker that "
        "queues the request is waited for)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-delivery", action=argparse.BooleanOptionalAction, default=True,
        help="each decode worker sends this router one stream carrying every request's tokens, "
        "a step's in one message (DecodeWorker.Deliver); --no-decode-delivery: a stream per "
        "request (more CPU per token on both ends; what a worker without Deliver gets anyway)",
    )  # fmt: skip
    parser.add_argument(
        "--max-migrations", type=int, default=2,
        help="times one stream may move to another (prefill, decode) pair when its decode "
        "worker is lost; then UNAVAILABLE",
    )  # fmt: skip
    parser.add_argument(
        "--max-local-prefill-tokens", type=non_negative_int,
        default=DEFAULT_LOCAL_PREFILL.max_tokens,
        help="conditional disaggregation (e.g. 512; `pagedserve up` sets 512): a prompt of at "
        "most this many tokens is computed by the decode worker itself while the prefill "
        "worker has --local-prefill-queue-tokens queued (docs/router.md). 0 (default): always "
        "a prefill worker, for workers on separate hosts",
    )  # fmt: skip
    parser.add_argument(
        "--local-prefill-queue-tokens", type=non_negative_int,
        default=DEFAULT_LOCAL_PREFILL.queue_tokens,
        help="prompt tokens queued at the chosen prefill worker from which short prompts are "
        "prefilled on the decode worker (0: whenever they are short enough)",
    )  # fmt: skip
    parser.add_argument(
        "--max-local-suffix-tokens", type=non_negative_int,
        default=DEFAULT_LOCAL_PREFILL.max_suffix_tokens,
        help="conditional disaggregation by locality: a decode worker that holds more of a "
        "prompt's leading blocks than the chosen prefill worker (a conversation's next turn) "
        "computes the prompt itself when at most this many of its tokens are not cached there "
        "(docs/router.md). 0: never",
    )  # fmt: skip
    parser.add_argument(
        "--index-timeout", type=float, default=0.04,
        help="seconds a prefix-index lookup may take before routing by load alone",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", default=None, metavar="FILE",
        help="require API keys: one tenant:key a line (else $PAGEDSERVE_API_KEYS, else none)",
    )  # fmt: skip
