"""`DraftModel`: speculative decoding's draft-model proposer (docs/speculative.md).

A smaller model of the same vocabulary runs beside the target in the decode worker. Its KV
cache has the target's block count and block size, and each sequence uses its own block table
for both. A block id therefore holds the target's and the draft's KV of the same positions,
and the draft needs no allocator of its own: its KV lives and dies with the target's blocks,
in the same pool accounting.

The draft's KV of a sequence is valid up to `Sequence.num_draft_computed` positions. Other
positions may hold another sequence's values or nothing. The engine resets the counter when a
sequence is preempted, since swap moves only the target's KV. A sequence that starts from
imported or prefix-cached blocks begins at 0 too. One proposal, for every speculating
sequence together::

    catch up:  | num_draft_computed .. x_last |  one forward, the argmax after x_last: d_1
    then:      | d_1 | ... | d_(k-1) |            k - 1 forwards of one token each: d_2 .. d_k

The draft writes its KV into slots the scheduler already gave the proposals (the target's
verification needs the same slots). Greedy drafting makes the draft's distribution a single
token, so verification is the same as for n-gram proposals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.kernels import dispatch
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.model.config import ModelConfig
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.requests.batch import DRAFT_PENDING, RunnerOutput, ScheduledSequence
from pagedserve.model.requests.sequence import Sequence
from pagedserve.model.runner import Chunk, kv_cache_spec, model_inputs
from pagedserve.model.sampler import greedy_tokens


class ModelProposer(Protocol):
    """What the decode engine asks of a proposer that computes (a draft model here; an
    EAGLE-style head reading the target's hidden states would be another): the `k` proposals
    of each request, whose slots the scheduler has allocated in the target's blocks, and the
    step's copy-on-write copies applied to whatever KV it keeps in those blocks."""

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...


@dataclass(slots=True)
class DraftRequest:
    """One sequence to propose `k` tokens for, after its last token."""

    seq: Sequence
    k: int


class DraftModel:
    """Owns the draft's weights and its KV cache (`num_blocks` blocks of `block_size`)."""

    def __init__(
        self,
        config: ModelConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(device)
        self.kv_cache = KVCache(kv_cache_spec(config, block_size), num_blocks, self.device)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """The `k` greedy tokens of each request, in order. Sets each sequence's
        `num_draft_computed` to its token count (its last token's KV is now the draft's too);
        the caller adds the proposals verification accepted (`settle`)."""
        if not requests:
            return []
        seqs = [r.seq for r in requests]
        first = self._step([(s, s.num_draft_computed, s.token_ids[s.num_draft_computed :])
                            for s in seqs])  # fmt: skip
        proposals = [[token] for token in first]
        for step in range(1, max(r.k for r in requests)):
            more = [i for i, r in enumerate(requests) if step < r.k]
            # NOTE: proposal `step` (d_step) goes in at position num_tokens + step - 1
            fed = [(seqs[i], seqs[i].num_tokens + step - 1, [proposals[i][-1]]) for i in more]
            for i, token in zip(more, self._step(fed), strict=True):
                proposals[i].append(token)
        for seq in seqs:
            seq.num_draft_computed = seq.num_tokens
        return proposals

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The step's copy-on-write pairs, in the draft's cache too."""
        dispatch.copy_blocks(self.kv_cache.tensor, pairs)

    @staticmethod
    def settle(seq: Sequence, k: int, num_accepted: int) -> None:
        """After verification: the draft's KV of the accepted proposals is valid too (it fed
        d_1 .. d_(k-1), so at most k - 1 of them)."""
        seq.num_draft_computed += min(num_accepted, k - 1)

    def _step(self, chunks: list[Chunk]) -> list[int]:
        """One forward of the draft over each (sequence, first position, tokens) chunk,
        writing their KV; returns the argmax after each chunk's last token."""
        input_ids, positions, meta = model_inputs(chunks, self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
            last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
            logits = self.model.compute_logits(hidden[last])
        return greedy_tokens(logits).tolist()


def fill_drafts(
    draft: ModelProposer, scheduled: list[ScheduledSequence], preempted: list[Sequence]
) -> list[int]:
    """Forget the draft KV of `preempted` sequences (swap moves only the target's), then
    replace, in place, every chunk of `scheduled` whose proposals are `DRAFT_PENDING` by one
    holding the draft's proposals. Returns the indices of the chunks filled."""
    for seq in preempted:
        seq.num_draft_computed = 0
    filled = [
        i for i, item in enumerate(scheduled) if item.draft and item.draft[0] == DRAFT_PENDING
    ]
    requests = [DraftRequest(scheduled[i].seq, len(scheduled[i].draft)) for i in filled]
    for i, tokens in zip(filled, draft.propose(requests), strict=True):
        item = scheduled[i]
        scheduled[i] = ScheduledSequence(item.seq, item.num_new_tokens, tuple(tokens))
    return filled


def settle_drafts(
    scheduled: list[ScheduledSequence], filled: list[int], output: RunnerOutput
) -> None:
    """After verification, count the accepted proposals' draft KV (`DraftModel.settle`)."""
    for i in filled:
        sampled = output.sampled[i]
        if sampled is not None:
            DraftModel.settle(scheduled[i].seq, len(scheduled[i].draft), sampled.num_accepted)
