"""Prefill throughput: the prefill worker's `PrefillEngine` vs transformers' forward, same prompts.

    python -m pagedserve.bench.prefill [--layers 4 --hidden 256] [--prompts 16] [--reps 5]
    pagedserve bench prefill ...

A random-weight Llama (`make_tiny_model`, in a temp dir) and a set of random prompts of mixed
lengths. Each peer lives in its own process, loads the model once and runs the whole prompt set
once untimed; then the repetitions are interleaved (one peer at a time, the order rotated every
repetition), each timing one pass over every prompt:

    pagedserve   PrefillEngine.add_sequence() every prompt, step() until all have their first token
                 (batched + chunked under --max-num-batched-tokens, paged KV written, prefix
                 caching off so repetitions do not hit)
    hf-one       transformers forward per prompt, batch 1, no padding, use_cache=True (the KV is
                 built), logits of the last position only
    hf-padded    transformers forward over all prompts in one left-padded batch (useful tokens
                 only are credited)

Throughput = prompt tokens / seconds of the pass (`--clock wall`, or `--clock cpu`: the peer
process's CPU seconds, which a shared, noisy machine disturbs far less; use it with --threads
1). Ratios are per repetition (pagedserve's tok/s over the peer's); the table gives medians and
min-max spreads. Correctness gate (S10): every peer's first tokens must equal
pagedserve's (greedy), else the run fails (exit 1).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch

PEERS = ("pagedserve", "hf-one", "hf-padded")
PAD_ID = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench prefill", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16, help="prompts per pass")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (>= 3)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads per peer (0: default)")
    p.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall: perf_counter; cpu: the peer process's CPU time (robust on a shared machine "
        "when used with --threads 1; counts every thread's CPU time)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    return p


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g).tolist()
    return [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lens]


# -- peers (each runs in its own process) -------------------------------------------------------


class PagedPeer:
    def __init__(self, model_dir: str, prompts: list[list[int]], args: argparse.Namespace) -> None:
        from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
        from pagedserve.sampling_params import SamplingParams

        blocks = sum(-(-len(p) // args.block_size) for p in prompts)
        config = PrefillEngineConfig(
            block_size=args.block_size,
            num_blocks=blocks + 1,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=len(prompts),
            enable_prefix_caching=False,
            use_shm=False,
            device=args.device,
        )
        self.engine = PrefillEngine.from_model_dir(model_dir, config)
        self.params = SamplingParams(temperature=0.0, max_tokens=1)  # no lease: blocks freed
        self.prompts = prompts
        self.passes = 0

    def run(self) -> list[int]:
        self.passes += 1
        engine = self.engine
        seqs = [
            engine.new_sequence(p, self.params, request_id=f"{self.passes}-{i}")
            for i, p in enumerate(self.prompts)
        ]
        for seq in seqs:
            engine.add_sequence(seq)
        while engine.has_unfinished:
            for seq in engine.step().done:
                engine.free(seq.block_table)
        return [seq.output_token_ids[0] for seq in seqs]


class HfPeer:
    def __init__(self, model_dir: str, prompts: list[list[int]], args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = self.model.to(args.device).eval()
        self.device = args.device
        self.prompts = prompts

    @torch.inference_mode()
    def run_one(self) -> list[int]:
        first = []
        for prompt in self.prompts:
            ids = torch.tensor([prompt], device=self.device)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            first.append(int(out.logits[0, -1].argmax()))
        return first

    @torch.inference_mode()
    def run_padded(self) -> list[int]:
        width = max(len(p) for p in self.prompts)
        ids = torch.full((len(self.prompts), width), PAD_ID, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(self.prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].argmax(-1).tolist()


def _serve(peer: str, model_dir: str, prompts: list[list[int]], args: argparse.Namespace,
           conn: Connection) -> None:  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    if peer == "pagedserve":
        run = PagedPeer(model_dir, prompts, args).run
    else:
        hf = HfPeer(model_dir, prompts, args)
        run = hf.run_one if peer == "hf-one" else hf.run_padded
    run()  # NOTE: warm-up pass (allocator, kernels, caches), not timed
    conn.send("ready")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    while conn.recv() == "run":
        _sync(args.device)
        start = clock()
        first = run()
        _sync(args.device)
        conn.send((clock() - start, first))
    conn.close()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- driver -------------------------------------------------------------------------------------


def measure(model_dir: str, prompts: list[list[int]], args: argparse.Namespace):
    """{peer: [seconds per repetition]} and {peer: first tokens}, peers interleaved."""
    ctx = mp.get_context("spawn")
    conns: dict[str, Connection] = {}
    procs = []
    for peer in PEERS:  # NOTE: started one at a time so that model loads do not overlap
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(peer, model_dir, prompts, args, child))
        proc.start()
        if not parent.poll(600) or parent.recv() != "ready":
            raise RuntimeError(f"{peer}: did not start")
        conns[peer] = parent
        procs.append(proc)
    seconds: dict[str, list[float]] = {p: [] for p in PEERS}
    first: dict[str, list[int]] = {}
    try:
        for rep in range(args.reps):
            order = PEERS[rep % len(PEERS) :] + PEERS[: rep % len(PEERS)]
            for peer in order:
                conns[peer].send("run")
                elapsed, tokens = conns[peer].recv()
                seconds[peer].append(elapsed)
                first[peer] = tokens
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    finally:
        for conn in conns.values():
            conn.send("stop")
        for proc in procs:
            proc.join(30)
    return seconds, first


def markdown(
    args: argparse.Namespace, prompts: list[list[int]], seconds: dict[str, list[float]]
) -> str:
    tokens = sum(len(p) for p in prompts)
    tps = {peer: [tokens / s for s in secs] for peer, secs in seconds.items()}
    lens = [len(p) for p in prompts]
    lines = [
        f"Prefill throughput, {len(prompts)} prompts of {min(lens)}-{max(lens)} tokens "
        f"({tokens} in all), {args.reps} interleaved repetitions, one process per peer, "
        f"{args.clock} clock.",
        f"Model: random Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
        f"{args.kv_heads} KV heads, vocab {args.vocab}, float32, {args.device}; "
        f"pagedserve budget {args.max_num_batched_tokens} tokens/step, block {args.block_size}.",
        f"Machine: {platform.machine()} {platform.processor() or ''}, "
        f"{torch.get_num_threads() if not args.threads else args.threads} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}.",
        "",
        "| peer | prompt tok/s (median) | min-max | pagedserve ÷ peer (median) | min-max |",
        "|---|---|---|---|---|",
    ]
    for peer in PEERS:
        ratios = [a / b for a, b in zip(tps["pagedserve"], tps[peer], strict=True)]
        lines.append(
            f"| {peer} | {statistics.median(tps[peer]):,.0f} | "
            f"{min(tps[peer]):,.0f}-{max(tps[peer]):,.0f} | "
            f"{statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps < 3:
        raise ValueError(f"--reps: at least 3 interleaved repetitions, got {args.reps}")
    if not 3 < args.min_len <= args.max_len:
        raise ValueError("--min-len/--max-len: need 3 < min-len <= max-len")
    from pagedserve.tiny_model import make_tiny_model

    prompts = make_prompts(args)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        model_dir = make_tiny_model(
            tmp,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
            max_position_embeddings=max(2048, args.max_len),
        )
        seconds, first = measure(str(model_dir), prompts, args)
    table = markdown(args, prompts, seconds)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    wrong = [peer for peer in PEERS if first[peer] != first["pagedserve"]]
    if wrong:
        print(f"correctness gate FAILED: first tokens differ for {wrong}", file=sys.stderr)
        return 1
    print("correctness gate: every peer's first tokens equal pagedserve's", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
