"""Benchmark peers, each in its own process, driven over stdin/stdout.

    python -m pagedserve.bench.peers NAME --model DIR [peer options]

NAME is `engine` (pagedserve `DecodeEngine`, in process, no gRPC), `cluster` (router + prefill +
decode via `start_cluster`, driven by the load generator), `hf-static` (transformers
`generate()` on padded batches, best batch size of a sweep) or `hf-cb` (transformers continuous
batching). The process loads its model, prints `READY`, then for each JSON line on stdin
(`{"requests": FILE, ...run options}`) runs the requests once and prints `RESULT {json}`. EOF
ends it. Keeping one process per peer for all repetitions lets the driver interleave them
without paying model loads in the measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

if __name__ == "__main__" and sys.argv[1:2] == ["engine"]:
    # NOTE: our engine as `pagedserve prefill|decode` run it: before torch is imported
    from pagedserve.host_memory import reuse_freed_memory

    reuse_freed_memory()

import torch  # noqa: E402

from pagedserve.bench.metrics import peer_report, request_result
from pagedserve.bench.workloads import BenchRequest, load_requests
from pagedserve.kvstore.eviction import DEFAULT_EVICTION_POLICY, EvictionPolicy
from pagedserve.launcher import add_local_prefill_arguments

# -- transformers static ------------------------------------------------------------------------


class HFStatic:
    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=_dtype(args.dtype))
        self.model = model.eval()
        self.batch_sizes: list[int] = args.batch_sizes
        self.best: int | None = None
        self.sweep: dict[int, float] = {}

    def _batch(self, batch: list[BenchRequest]) -> list[list[int]]:
        from transformers import GenerationConfig

        width = max(len(r.prompt) for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.tensor([[2] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        config = GenerationConfig(
            do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=2
        )
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        return [out[i, width : width + r.output_len].tolist() for i, r in enumerate(batch)]

    def _run_with(self, requests: list[BenchRequest], size: int) -> tuple[list, float]:
        results = [request_result(r) for r in requests]
        start = time.perf_counter()
        for i in range(0, len(requests), size):
            for res, toks in zip(
                results[i : i + size], self._batch(requests[i : i + size]), strict=True
            ):
                res.tokens = toks
                res.token_times = [time.perf_counter() - start]
        return results, time.perf_counter() - start

    def run(self, requests: list[BenchRequest], options: dict) -> dict:
        if self.best is None:
            probe = requests[: max(self.batch_sizes)]
            for size in self.batch_sizes:
                res, secs = self._run_with(probe, size)
                self.sweep[size] = sum(r.useful_tokens for r in res) / secs
            self.best = max(self.sweep, key=lambda s: self.sweep[s])
        results, duration = self._run_with(requests, self.best)
        return peer_report(results, duration, batch_size=self.best, sweep_tok_s=self.sweep)


# -- transformers continuous batching -------------------------------------------------------------


class HFContinuous:
    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=_dtype(args.dtype), attn_implementation="sdpa"
        )
        self.model = model.eval()

    def run(self, requests: list[BenchRequest], options: dict) -> dict:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        # NOTE: without a bound, transformers sizes the paged cache from free host memory (on CPU
        # without psutil it took 14 GB and was OOM-killed); a fixed 1024 pages of 256 tokens is
        # 15.9 GB on a 30-layer model. Enough pages for the whole workload at once, no more.
        page = ContinuousBatchingConfig().page_size
        pages = sum(-(-(len(r.prompt) + r.output_len) // page) for r in requests) + 8
        cb_config = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=2048)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.output_len for r in requests),
            eos_token_id=-1,
            pad_token_id=2,
        )
        results = {r.request_id: request_result(r) for r in requests}
        with self.model.continuous_batching_context_manager(
            generation_config=config,
            continuous_batching_config=cb_config,
            block=True,
            timeout=30,
            warmup=False,
        ) as manager:
            start = time.perf_counter()
            for r in requests:
                manager.add_request(r.prompt, request_id=r.request_id, max_new_tokens=r.output_len)
            pending = set(results)
            while pending:
                out = manager.get_result(timeout=60)
                if out is None:
                    raise RuntimeError("hf-cb: the continuous batching manager stopped")
                if out.is_finished() and out.request_id in pending:
                    pending.discard(out.request_id)
                    res = results[out.request_id]
                    res.tokens = list(out.generated_tokens)
                    res.token_times = [time.perf_counter() - start]
            duration = time.perf_counter() - start
        return peer_report(list(results.values()), duration)


# -- pagedserve cluster ---------------------------------------------------------------------------


class ClusterPeer:
    def __init__(self, args: argparse.Namespace) -> None:
        from pagedserve.launcher import start_cluster

        self.log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
        launch = argparse.Namespace(
            model=args.model, host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None,
            block_size=args.block_size, dtype=args.dtype, kv_cache_memory=_kv_bytes(args),
            otlp_traces_endpoint=None, metrics=False, start_timeout=180.0, log_dir=None,
            max_local_prefill_tokens=args.max_local_prefill_tokens,
            local_prefill_queue_tokens=args.local_prefill_queue_tokens,
            max_local_suffix_tokens=args.max_local_suffix_tokens,
            decode_delivery=args.decode_delivery,
        )  # fmt: skip
        self.cluster = start_cluster(launch, self.log_dir)

    def run(self, requests: list[BenchRequest], options: dict) -> dict:
        from pagedserve.bench.loadgen import run_load

        return run_load(
            self.cluster.router_address,
            requests,
            max_concurrency=options.get("max_concurrency"),
            stream_interval=options.get("stream_interval", 0),
            cache_salt=options.get("cache_salt", ""),
        )

    def close(self) -> None:
        self.cluster.stop()


def _kv_bytes(args: argparse.Namespace) -> str:
    """The cluster's KV bytes per worker: `--kv-cache-memory`, else as many blocks as the
    engine peer has (`--num-blocks`). NOTE: a fixed byte size starved the real model: 256 MiB
    holds 355 of SmolLM2's 30-layer blocks, a third of the engine's 1,024, and S1's decode
    worker swapped half its batch out."""
    if args.kv_cache_memory:
        return args.kv_cache_memory
    from pagedserve.model.config import load_model_config
    from pagedserve.model.runner import kv_cache_spec

    config = load_model_config(args.model, args.dtype)
    return str(args.num_blocks * kv_cache_spec(config, args.block_size).bytes_per_block)


PEERS = {"hf-static": HFStatic, "hf-cb": HFContinuous, "cluster": ClusterPeer}


def _dtype(name: str | None) -> torch.dtype | str:
    return getattr(torch, name) if name else "auto"


def _make_peer(args: argparse.Namespace) -> Any:
    if args.name == "engine":
        # NOTE: imported here so that a transformers peer's process never loads pagedserve's engine
        from pagedserve.bench.engine_peer import EnginePeer

        return EnginePeer(args)
    return PEERS[args.name](args)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedserve.bench.peers", description=__doc__)
    p.add_argument("name", choices=["engine", *PEERS])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024, help="engine: device KV blocks")
    p.add_argument("--num-swap-blocks", type=int, default=1024, help="engine: host KV blocks")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--eviction-policy", default=DEFAULT_EVICTION_POLICY.value,
        choices=[e.value for e in EvictionPolicy], help="engine: prefix-cache eviction",
    )  # fmt: skip
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    p.add_argument("--policy", default="priority", choices=["fcfs", "priority"])
    p.add_argument("--kv-policy", default="paged", choices=["paged", "reserve-max"])
    p.add_argument(
        "--kv-cache-memory", default=None,
        help="cluster: KV bytes per worker (default: the engine's --num-blocks at this model's "
        "block size, so both run with the same KV budget)",
    )  # fmt: skip
    add_local_prefill_arguments(p)  # NOTE: the cluster peer's, `pagedserve up`'s defaults
    p.add_argument(
        "--decode-delivery", action=argparse.BooleanOptionalAction, default=True,
        help="cluster: the router's (one Deliver stream per decode worker)",
    )  # fmt: skip
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32], help="hf-static sweep")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    peer = _make_peer(args)
    print("READY", flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            options = json.loads(line)
            try:
                out = peer.run(load_requests(options["requests"]), options)
            except Exception as e:  # NOTE: reported to the driver, which marks the peer failed
                out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print("RESULT " + json.dumps(out), flush=True)
    finally:
        if hasattr(peer, "close"):
            peer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
