"""Requests that run as several sequences: samples (`SampleGroups`) and beam searches
(`BeamGroups`). Torch-free, like the scheduler that holds them.

A request with several samples runs as one sequence per sample, forked from sample 0
(`fork_samples`): the samples share the prompt's blocks (each holds its own references) and
one rank, so they are scheduled side by side and preempted as one unit (`Preemptor`). A beam
search's beams are such samples; after every step the search keeps the best beams, and each
kept beam continues one of the previous beams (its table a fork of that beam's)::

    step:        beam 0: [ p | a ]   beam 1: [ p | b ]      the candidates of both beams
    search:      best two: a+x, a+y                         both continue beam 0
    reassigned:  beam 0: [ p | a x ] beam 1: [ p | a y ]    beam 1's table: a fork of beam 0's
"""

from __future__ import annotations

from pagedserve.decode_worker.plan import SchedulerConfig
from pagedserve.decode_worker.queues import Rank, SequenceQueues
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.model.requests.batch import SampledToken, ScheduledSequence
from pagedserve.model.requests.beam_search import (
    BeamSearch,
    hypothesis_finish_is_stop,
    new_beam_search,
)
from pagedserve.model.requests.sequence import FinishReason, SampleGroup, Sequence, fork_samples

BeamRows = list[tuple[ScheduledSequence, SampledToken]]


class SampleGroups:
    """Queues the samples forked from a queued sequence beside it."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, queues: SequenceQueues):
        self.config = config
        self.kv = kv
        self.queues = queues

    def add(self, rank: Rank, samples: list[Sequence]) -> list[Sequence]:
        """Queue forked samples at `rank`: running (sharing the prompt's blocks) while seats
        last, else waiting with an empty table (they recompute, hitting the prefix cache).
        Returns those their first token already finished, their blocks freed."""
        finished: list[Sequence] = []
        for seq in samples:
            self.queues.check_unused(seq)
            beam = seq.params.use_beam_search  # NOTE: the search decides when beams end
            if not beam and seq.check_stop(self.config.eos_token_ids, self.config.max_model_len):
                self.kv.free(seq.block_table)
                finished.append(seq)
                continue
            entry = self.queues.register(seq, rank)
            if seq.block_table.block_ids and len(self.queues.running) < self.config.max_num_seqs:
                self.queues.push_running(entry)
            else:
                self.kv.free(seq.block_table)
                seq.num_computed_tokens = 0
                self.queues.push_waiting(entry)
        return finished

    def add_beside(self, seq: Sequence, samples: list[Sequence]) -> list[Sequence]:
        """`add` at the rank of `seq` (queued; the sample they were forked from)."""
        return self.add(self.queues.entries[seq.request_id].rank, samples)

    def fork(self, seq: Sequence, sampled: SampledToken) -> list[Sequence]:
        """Fork the samples `seq` (sample 0, queued) drew first tokens for (`sampled.forks`)
        and queue them beside it; returns those already finished. NOTE: call it before `seq`'s
        blocks can be freed: the samples share them."""
        forks = [(token.token_id, token.logprobs) for token in sampled.forks]
        return self.add_beside(seq, fork_samples(seq, forks))


class BeamGroups:
    """Runs the beam searches: starts them, applies each step's candidates to the beams, and
    rewrites the beams with the best hypotheses at the end. Frees no queued sequence: the
    scheduler takes a finished search's beams out of its queues first."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, samples: SampleGroups):
        self.config = config
        self.kv = kv
        self.samples = samples

    def start(
        self, parent: Sequence, candidates: list[tuple[int, float]]
    ) -> tuple[list[Sequence], bool]:
        """Start `parent`'s search from the prompt's candidates (token, logprob): it takes the
        best beam's token; the other beams are forked from it (not queued). Returns them and
        whether the search ended."""
        limit = min(parent.params.max_tokens, self.config.max_model_len - parent.num_prompt_tokens)
        search = new_beam_search(parent.params, self.config.eos_token_ids, limit)
        step = search.step([candidates], [[]])
        parent.append_token(step.tokens[0], None)
        samples = fork_samples(parent, [(token, None) for token in step.tokens[1:]])
        group_of(parent).beam = search
        return samples, step.done

    def step(self, rows: BeamRows) -> tuple[list[Sequence], bool]:
        """One beam-search step of a request whose beams (`rows`) completed a forward. Returns
        the beams forked and already finished (the first step's) and whether the search ended
        (then `finish` it)."""
        first = rows[0][0].seq
        if first.group is None:  # NOTE: the prompt's last row: the first step forks the beams
            item, sampled = rows[0]
            self._advance_computed(item, item.num_new_tokens)
            samples, done = self.start(first, sampled.candidates)
            return self.samples.add_beside(first, samples), done
        group = group_of(first)
        if len(rows) != len(group.members):
            # NOTE: not every beam ran (a budget, a seat, a recompute): the step waits for
            # them; the last token's KV is computed again with theirs
            for item, _ in rows:
                self._advance_computed(item, item.num_new_tokens - 1)
            return [], False
        rows = sorted(rows, key=lambda row: row[0].seq.sample_index)
        for item, _ in rows:
            self._advance_computed(item, item.num_new_tokens)
        members = [item.seq for item, _ in rows]
        step = _some_beam(group).step(
            [sampled.candidates for _, sampled in rows], [m.output_token_ids for m in members]
        )
        self._reassign_beams(members, step.parents, step.tokens)
        return [], step.done

    def finish(self, beam: Sequence) -> list[Sequence]:
        """End `beam`'s search once the scheduler took its beams out of the queues (their
        blocks freed): beam i < n gets the i-th best finished hypothesis. Returns every beam,
        finished."""
        group = group_of(beam)
        search = _some_beam(group)
        best = search.best(group.members[0].params.n)
        for member in group.members:
            index = member.sample_index
            if index < len(best):
                hypothesis = best[index]
                member.token_ids = [*member.prompt_token_ids, *hypothesis.token_ids]
                member.output_logprobs = [None] * len(hypothesis.token_ids)
                stop = hypothesis_finish_is_stop(hypothesis, search.stop_ids)
                member.finish(FinishReason.STOP if stop else FinishReason.LENGTH)
            else:
                member.finish(FinishReason.STOP)
        return list(group.members)

    def _advance_computed(self, item: ScheduledSequence, num_tokens: int) -> None:
        seq = item.seq
        seq.num_computed_tokens += num_tokens
        self.kv.cache_full_blocks(seq.block_table, seq.block_hashes, seq.num_computed_tokens)

    def _reassign_beams(
        self, members: list[Sequence], parents: list[int], tokens: list[int]
    ) -> None:
        """Beam j continues beam `parents[j]` with `tokens[j]`: its table becomes a fork of
        the parent's (sharing every block; the partial last block is copied on the next
        write), and blocks only dropped beams held are freed."""
        tables = [members[p].block_table.fork() for p in parents]
        olds = [(m.token_ids, m.block_hashes, m.num_computed_tokens) for m in members]
        for member in members:
            self.kv.free(member.block_table)
        for member, table, parent, token in zip(members, tables, parents, tokens, strict=True):
            token_ids, hashes, computed = olds[parent]
            member.block_table = table
            member.token_ids = [*token_ids, token]
            member.output_logprobs = [None] * member.num_output_tokens
            member.block_hashes = list(hashes)
            member.update_block_hashes()
            member.num_computed_tokens = computed


def group_of(seq: Sequence) -> SampleGroup:
    """`seq`'s sample group; RuntimeError when it was never forked."""
    if seq.group is None:
        raise RuntimeError(f"{seq.request_id}: not forked into samples")
    return seq.group


def _some_beam(group: SampleGroup) -> BeamSearch:
    if group.beam is None:
        raise RuntimeError(f"{group.request_id}: not a beam search")
    return group.beam
