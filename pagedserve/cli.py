"""The `pagedserve` command line. Each subcommand imports only what it needs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="write a small random-weight Llama-family model and tokenizer (offline)",
    )
    p.add_argument("dir", help="output directory (created)")
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2"])
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


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate in-process (no servers): a smoke test of a model")
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.model.engine import Engine, EngineConfig
    from pagedserve.sampling_params import SamplingParams

    engine = Engine.from_model_dir(
        args.model,
        EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, dtype=args.dtype),
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    (seq,) = engine.generate([tokenizer(args.prompt)["input_ids"]], params)
    print(tokenizer.decode(seq.output_token_ids, skip_special_tokens=True))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)")
    kinds = p.add_subparsers(dest="bench", required=True)
    kernels = kinds.add_parser(
        "kernels",
        help="paged decode attention vs contiguous SDPA (python -m pagedserve.bench.kernels -h)",
        add_help=False,
    )
    kernels.set_defaults(func=_run_bench_kernels, passthrough=True)


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from pagedserve.bench import kernels

    return kernels.main(args.rest)


def _add_prefill(sub: argparse._SubParsersAction) -> None:
    from pagedserve.prefill_worker.cli_args import add_arguments

    p = sub.add_parser("prefill", help="run a prefill worker (gRPC pagedserve.v1.PrefillWorker)")
    add_arguments(p)
    p.set_defaults(func=_run_prefill)


def _run_prefill(args: argparse.Namespace) -> int:
    from pagedserve.prefill_worker.server import main as serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_prefill(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # NOTE: benchmark subcommands own their options (parsed where torch is already imported).
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
