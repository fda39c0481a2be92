"""How a sequence starts and advances: the rules every scheduler shares.

`admit`: a waiting sequence reuses the longest run of its full prompt blocks already in the
prefix cache, then allocates slots for as much of the rest as the token budget allows:

    prompt:  | cached blocks (no compute) | this chunk (<= budget) | later chunks |

The prompt's last token is always computed, even on a full hit, because its logits are sampled.
A sequence that wants prompt logprobs takes no hit: every position's logits are needed.

`advance`: after a forward, a scheduled chunk's tokens count as computed, newly full blocks join
the prefix cache, and a sampled token is appended and checked against the stop conditions.
"""

from __future__ import annotations

from pagedserve.kvstore.block_pool import BlockId
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import SampledToken, ScheduledSequence, TokenLogprobs
from pagedserve.model.requests.sequence import Sequence, SequenceStatus


def admit(
    kv: KVCacheManager, seq: Sequence, budget: int, *, prefix_caching: bool
) -> tuple[ScheduledSequence, list[tuple[BlockId, BlockId]]] | None:
    """Allocate `seq`'s first chunk (ask then commit) and mark it RUNNING.

    Returns the scheduled chunk and any copy-on-write pairs the caller must apply before the
    forward, or None (nothing changed) when the pool cannot hold the chunk. `budget` >= 1.
    """
    block_size = kv.pool.block_size
    prefix: list[BlockId] = []
    if prefix_caching and not seq.wants_prompt_logprobs:
        max_blocks = (seq.num_tokens - 1) // block_size
        prefix = kv.match_prefix(seq.block_hashes, max_blocks)
    num_cached = len(prefix) * block_size
    n = min(seq.num_tokens - num_cached, budget)
    pairs = kv.allocate(seq.block_table, num_cached + n, prefix)
    if pairs is None:
        return None
    seq.num_computed_tokens = num_cached
    if seq.num_output_tokens == 0:
        seq.num_cached_prompt_tokens = num_cached
    seq.status = SequenceStatus.RUNNING
    return ScheduledSequence(seq, n), pairs


def advance(
    kv: KVCacheManager,
    item: ScheduledSequence,
    sampled: SampledToken | None,
    *,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    prompt_logprobs: list[TokenLogprobs] | None = None,
) -> bool:
    """Apply one step's result to `item.seq` (with the chunk's `prompt_logprobs`, the next
    ones of its prompt); True if the sequence finished (blocks not freed)."""
    seq = item.seq
    if sampled is not None and sampled.extra:
        return _advance_speculative(kv, item, sampled, eos_token_ids, max_model_len)
    seq.prompt_logprobs += prompt_logprobs or []
    seq.num_computed_tokens += item.num_new_tokens
    kv.cache_full_blocks(seq.block_table, seq.block_hashes, seq.num_computed_tokens)
    if sampled is None:
        return False
    seq.append_token(sampled.token_id, sampled.logprobs)
    return seq.check_stop(eos_token_ids, max_model_len)


def _advance_speculative(
    kv: KVCacheManager,
    item: ScheduledSequence,
    sampled: SampledToken,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> bool:
    """Append a verification's emitted tokens one by one, each checked against the stop
    conditions as if decoded alone (a stop drops the rest). The KV of the last token and of
    every accepted proposal is computed; a rejected proposal's slot is not (the caller trims
    it, `BlockTable.truncate`)::

        fed:      | x_last | d_1 .. d_m (accepted) | d_(m+1) .. d_k (rejected) |
        computed: |<------------ 1 + m ----------->|
    """
    seq = item.seq
    num_fed = seq.num_computed_tokens + item.num_new_tokens + sampled.num_accepted
    done = False
    for token_id in (sampled.token_id, *sampled.extra):
        seq.append_token(token_id, None)
        if seq.check_stop(eos_token_ids, max_model_len):
            done = True
            break
    # NOTE: the newest token's KV is never computed yet, as after a plain decode step
    seq.num_computed_tokens = min(num_fed, seq.num_tokens - 1)
    kv.cache_full_blocks(seq.block_table, seq.block_hashes, seq.num_computed_tokens)
    return done
