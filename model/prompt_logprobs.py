"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens
before it, computed from the logits of the prefill forward that the prompt runs anyway.

The logits at position p predict token p + 1, so a chunk of positions [start, end) gives the
logprobs of prompt tokens start + 1 .. end (the last prompt position predicts the first output
token, which the sampler draws)::

    prompt tokens:  | t0 | t1 | t2 | t3 | t4 |          (t0 has no context: no logprob)
    chunk:               |<- start    end ->|
    rows wanted:    p in [max(start, collected), min(end, len(prompt) - 1))
                    where `collected` = len(seq.prompt_logprobs): tokens 1 .. collected are done

A prompt computed twice (a preemption by recompute) is not collected twice. Raw: log_softmax of
the model's float32 logits, before penalties, temperature or grammar masks, as the sampler's
logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagedserve.model.requests.batch import ScheduledSequence, TokenLogprobs


@dataclass(slots=True)
class PromptLogitRows:
    """The hidden rows of one step whose logits give prompt logprobs, with what each row is
    about: `rows` index the step's hidden states; `targets[i]` / `num_top[i]` are the prompt
    token ids (and alternatives wanted) of scheduled sequence i, one per row of it, in order."""

    rows: list[int]
    targets: list[list[int]]
    num_top: list[int]


def prompt_logit_rows(batch: Seq[ScheduledSequence]) -> PromptLogitRows:
    """Which rows of this step's forward give prompt logprobs (none: `rows` empty).

    RuntimeError if a chunk starts past the prompt logprobs collected so far (positions whose
    logits were never computed: a prefix-cache hit the scheduler must not have taken)."""
    out = PromptLogitRows([], [], [])
    offset = 0
    for item in batch:
        seq, start = item.seq, item.seq.num_computed_tokens
        targets: list[int] = []
        if seq.wants_prompt_logprobs:
            collected = len(seq.prompt_logprobs)
            if start > collected:
                raise RuntimeError(
                    f"{seq.request_id}: prompt logprobs of tokens {collected + 1}..{start} "
                    "were never computed"
                )
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            for p in range(collected, end):
                out.rows.append(offset + p - start)
                targets.append(seq.token_ids[p + 1])
        out.targets.append(targets)
        out.num_top.append(seq.params.prompt_logprobs or 0)
        offset += item.num_new_tokens
    return out


def prompt_logprobs(logits: torch.Tensor, plan: PromptLogitRows) -> list[list[TokenLogprobs]]:
    """Per scheduled sequence, the `TokenLogprobs` of its rows (`logits`: [len(plan.rows),
    vocab] float32, in `plan.rows` order): the prompt token's logprob, its rank (1 = most
    likely; ties count against it, as the sampler's) and the top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(
        [t for ids in plan.targets for t in ids], dtype=torch.int64, device=logits.device
    )
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    k = min(max(plan.num_top), logprobs.shape[-1])
    top = torch.topk(logprobs, k, dim=-1)
    top_ids, top_lps, values = top.indices.tolist(), top.values.tolist(), chosen[:, 0].tolist()
    out: list[list[TokenLogprobs]] = []
    row = 0
    for ids, num_top in zip(plan.targets, plan.num_top, strict=True):
        entries = []
        for token_id in ids:
            pairs = list(zip(top_ids[row][:num_top], top_lps[row][:num_top], strict=True))
            entries.append(TokenLogprobs(token_id, values[row], ranks[row], pairs))
            row += 1
        out.append(entries)
    return out
