"""The correctness gate (S10): greedy tokens of a sample of a scenario's requests must equal
transformers `generate(do_sample=False)` run one prompt at a time, unpadded, EOS not stopping.

A failing gate marks the scenario's run invalid; its numbers are still reported, flagged.

In bf16 and fp16 (`--dtype`), one near tie is forgiven: a batched GEMM sums in another order
than a one-prompt one, so where transformers' top two logits are within the dtype's rounding
the argmax may legitimately flip (every engine, vLLM included, did so on SmolLM2 in bf16). A
first difference counts as such a tie when transformers' logit of our token is within
`NEAR_TIE_ULPS` units in the last place of its own token's logit (in the run's dtype); the rest
of that request is then not compared (it continues from another token), and the report lists
the tie with its margin. In fp32 the gate stays exact.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from pagedserve.bench.workloads import BenchRequest

DTYPE: str | None = None  # the run's `--dtype` (set once by the suite): the oracle computes in it
NEAR_TIE_ULPS = 4  # bf16 / fp16 only: a first difference this close to a tie is forgiven


@cache
def _hf_model(model_dir: str, dtype: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    options = {"dtype": getattr(torch, dtype)} if dtype else {}
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **options)
    return model.eval()


def hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    return hf_greedy_with_logits(model_dir, prompt, n)[0]


def hf_greedy_with_logits(
    model_dir: str, prompt: list[int], n: int
) -> tuple[list[int], torch.Tensor]:
    """(tokens, the logits each was chosen from [n, vocab], in the run's dtype)."""
    from transformers import GenerationConfig

    model = _hf_model(model_dir, DTYPE)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None, pad_token_id=2,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


def near_tie(logits: torch.Tensor, ref: int, ours: int) -> float | None:
    """transformers' margin of its token `ref` over `ours` at one step, if within
    `NEAR_TIE_ULPS` ulps of the run's reduced dtype (None: a real difference, or fp32)."""
    if DTYPE not in ("bfloat16", "float16") or not 0 <= ours < logits.shape[-1]:
        return None
    dtype = getattr(torch, DTYPE)
    top = logits[ref].to(dtype)
    margin = float(top.float() - logits[ours].to(dtype).float())
    ulp = float(torch.finfo(dtype).eps) * 2.0 ** torch.frexp(top.float().abs())[1].item() / 2
    return margin if margin <= NEAR_TIE_ULPS * ulp else None


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
    mismatches, ties = [], []
    for req in picked:
        n = min(req.output_len, max_tokens)
        ours = tokens.get(req.request_id, [])[:n]
        ref, logits = hf_greedy_with_logits(model_dir, req.prompt, n)
        if ours == ref:
            continue
        first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), n)
        margin = near_tie(logits[first], ref[first], ours[first]) if first < len(ours) else None
        if margin is None:
            mismatches.append({"request_id": req.request_id, "first_diff": first})
        else:
            ties.append({"request_id": req.request_id, "first_diff": first, "margin": margin})
    return {
        "passed": not mismatches,
        "checked": [r.request_id for r in picked],
        "tokens_per_request": max_tokens,
        "mismatches": mismatches,
        "near_ties": ties,
    }
