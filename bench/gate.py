"""The correctness gate (S10): greedy tokens of a sample of a scenario's requests must equal
transformers `generate(do_sample=False)` run one prompt at a time, unpadded, EOS not stopping.

A failing gate marks the scenario's run invalid; its numbers are still reported, flagged.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from pagedserve.bench.workloads import BenchRequest

DTYPE: str | None = None  # the run's `--dtype` (set once by the suite): the oracle computes in it


@cache
def _hf_model(model_dir: str, dtype: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    options = {"dtype": getattr(torch, dtype)} if dtype else {}
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **options)
    return model.eval()


def hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    model = _hf_model(model_dir, DTYPE)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None, pad_token_id=2
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def check(
    model_dir: str,
    requests: list[BenchRequest],
    tokens: dict[str, list[int]],
    *,
    sample: int = 3,
    max_tokens: int = 32,
) -> dict:
    """Compare the first `max_tokens` tokens of `sample` requests (spread over the set)."""
    step = max(1, len(requests) // sample)
    picked = requests[::step][:sample]
    mismatches = []
    for req in picked:
        n = min(req.output_len, max_tokens)
        ours = tokens.get(req.request_id, [])[:n]
        ref = hf_greedy(model_dir, req.prompt, n)
        if ours != ref:
            first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), n)
            mismatches.append({"request_id": req.request_id, "first_diff": first})
    return {
        "passed": not mismatches,
        "checked": [r.request_id for r in picked],
        "tokens_per_request": max_tokens,
        "mismatches": mismatches,
    }
