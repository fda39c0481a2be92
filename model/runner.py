"""`ModelRunner`: turns a plan (which sequences compute how many tokens) into tensors and back.

The runner never decides anything: schedulers hand it `ScheduledSequence`s whose blocks are
already allocated (model/requests/batch.py), and it returns what the model produced. It mutates
nothing but the KV cache (the slots of this step's tokens and any copy-on-write destination
blocks) and its sampler's generators (one draw per seeded, sampled row).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from pagedserve.kernels import dispatch, mkl_packed, onednn_packed
from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec
from pagedserve.model import gguf_weights, moe
from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_weights import GROUP as GGUF_GROUP
from pagedserve.model.grammar import Grammars
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.prompt_logprobs import prompt_logit_rows, prompt_logprobs
from pagedserve.model.quant import quantized_bytes
from pagedserve.model.requests.batch import RunnerOutput, SampledToken, ScheduledSequence
from pagedserve.model.requests.beam_search import beam_candidates_per_row
from pagedserve.model.requests.sequence import Sequence, sample_request_id
from pagedserve.model.sampler import Sampler, SamplingRow, greedy_tokens
from pagedserve.model.tp_pipes import RankLost, Ranks, RankStepMessage


def kv_cache_spec(config: ModelConfig, block_size: int) -> KVCacheSpec:
    """The page shape a model needs at a block size (KV dtype = the model's, unless its config
    stores the KV in 8 bits)."""
    return KVCacheSpec(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=config.kv_cache_dtype or config.dtype,
    )


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of a Llama-family model's weights in its dtype (embeddings, every layer's
    attention, MLP or mixture of experts and norms, the final norm and, unless tied, the LM
    head), as loaded: tensors a GGUF's Q8_0 blocks give (model/gguf_weights.py) count as int8
    with float32 group scales."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q, inner, size = (
        config.num_heads * config.head_dim,
        config.intermediate_size,
        config.dtype.itemsize,
    )
    method = gguf_weights.block_method(config.quantization) if config.tp is None else None
    gguf = gguf_weights.gguf_source(config.model_dir) if method else None
    kinds = gguf_weights.block_kinds(gguf, method) if gguf and method else {}

    def q8_0(name: str, in_features: int, out_features: int) -> int | None:
        if kinds.get(name) != "Q8_0":
            return None
        return out_features * in_features + out_features * (in_features // GGUF_GROUP) * 4

    # (in, out) of every linear layer of a decoder layer
    linears = {
        "self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inner), "mlp.up_proj": (h, inner),
        "mlp.down_proj": (inner, h),
    }  # fmt: skip
    weights = 0
    for layer in range(config.num_layers):
        for part, (i, o) in linears.items():
            q8 = q8_0(f"model.layers.{layer}.{part}.weight", i, o)
            if q8 is not None:
                weights += q8
            elif config.quantization is None:
                weights += i * o * size
            else:
                weights += quantized_bytes(i, o, config.quantization, config.dtype)
    biases = (q + 2 * kv) * config.qkv_bias + h * config.o_bias + (2 * inner + h) * config.mlp_bias
    qk_norms = {"": 0, "head": 2 * config.head_dim, "projection": q + kv}[config.qk_norm]
    norms = (4 if config.sandwich_norms else 2) * h + qk_norms  # NOTE: Gemma's four
    weights += config.num_layers * (biases + norms) * size
    weights += moe.sparse_mlp_elements(config) * size  # NOTE: MoE models are never quantized
    table = config.vocab_size * h
    embedding = q8_0(gguf_weights.EMBEDDING, h, config.vocab_size) or table * size
    head = 0 if config.tie_word_embeddings else (
        q8_0(gguf_weights.HEAD, h, config.vocab_size) or table * size
    )  # fmt: skip
    if config.quantization is not None and config.quantization.lm_head:
        tied_q8 = config.tie_word_embeddings and embedding != table * size
        if not (tied_q8 or q8_0(gguf_weights.HEAD, h, config.vocab_size)):
            # NOTE: int8 per channel; a tied head's copy comes beside the embedding
            head = table + config.vocab_size * size
    return weights + embedding + head + h * size


def packed_copy_bytes(config: ModelConfig, device: str) -> int:
    """Bytes of the copies of weights packed on CPU: fp32 weights for MKL (kernels/mkl_packed.py:
    when the native decode stack is built, or on a product of more than 16 rows), bf16 weights
    for oneDNN (kernels/onednn_packed.py: on a product of up to 16 rows, a decode step's). Either
    way every unquantized decoder linear's weight and the LM head's once more (a tied head packs
    the table). 0 where nothing is packed."""
    if not device.startswith("cpu"):
        return 0
    if config.dtype == torch.float32 and mkl_packed.available():
        size = 4
    elif config.dtype == torch.bfloat16 and onednn_packed.available():
        size = 2
    else:
        return 0
    quant = config.quantization
    h, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = 0 if quant is not None else h * (q + 2 * kv) + q * h + 3 * h * inner
    head = 0 if quant is not None and quant.lm_head else h
    return (config.num_layers * layer + head * config.vocab_size) * size


def rank_kv_cache_bytes(rank_config: ModelConfig, args: Any, ranks: int) -> int:
    """A worker rank's KV budget from its flags (`--kv-cache-memory`, `--kv-cache-memory-
    fraction`, `--device`): a device is each rank's own, but on CPU the tensor-parallel ranks
    share the host's memory, so each takes 1/N of the worker's budget."""
    budget = kv_cache_bytes(
        rank_config, args.device, args.kv_cache_memory, args.kv_cache_memory_fraction
    )
    return budget // ranks if args.device == "cpu" else budget


def device_memory_bytes(device: str) -> int:
    """What a worker on `device` may use: a CUDA device's total memory; on CPU the host's RAM,
    or the container's memory limit (cgroup v2 `memory.max`) when that is smaller."""
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return ram
    return min(ram, int(limit)) if limit.isdigit() else ram


def kv_cache_bytes(config: ModelConfig, device: str, memory: int, fraction: float | None) -> int:
    """The KV budget: `memory` bytes, or with `fraction` that share of the device's memory
    minus the weights. ValueError naming the flag when nothing is left for the cache.

    NOTE: activations are not profiled (vLLM runs a dummy forward to measure them): a fraction
    below 1 leaves them their room.
    """
    if fraction is None:
        return memory
    weights = weight_bytes(config) + packed_copy_bytes(config, device)
    budget = int(fraction * device_memory_bytes(device)) - weights
    if budget <= 0:
        raise ValueError(
            f"kv-cache-memory-fraction: {fraction:g} of the device's memory leaves nothing for "
            f"the KV cache after {weights / 2**30:.2f} GiB of weights"
        )
    return budget


class ModelRunner:
    """Owns the model weights and the device KV cache of one worker."""

    def __init__(
        self,
        config: ModelConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        kv_cache: KVCache | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        """`kv_cache`, when given (e.g. a shared-memory pool), must match the model's spec.
        `ranks`: on rank 0 of a tensor-parallel worker, the other ranks (model/tp_pipes.py),
        sent every step before this rank runs it."""
        self.config = config
        self.ranks = ranks
        self.model = model
        self.device = torch.device(device)
        self.spec = kv_cache_spec(config, block_size)
        if kv_cache is not None and (
            kv_cache.spec != self.spec or kv_cache.num_blocks != num_blocks
        ):
            raise ValueError("kv_cache: its spec or size does not match the model and num_blocks")
        self.kv_cache = kv_cache or KVCache(self.spec, num_blocks, self.device)
        self.sampler = Sampler(Grammars(config.model_dir, config.vocab_size, config.eos_token_ids))
        self._threads_set = ranks is None  # NOTE: with ranks, split at the first step
        dispatch.prepare(self.device, config.dtype)

    def set_threads(self, total: int) -> None:
        """Torch threads for this worker's forwards (`CoreShare` calls it before a step, on the
        thread that runs them): `total` here; with tensor-parallel ranks, which share the
        host's cores, `total // ranks` on each (rank 0 now, the others from the next plan)."""
        if self.ranks is not None:
            total = max(1, total // self.ranks.size)
            self.ranks.threads = total
        torch.set_num_threads(total)
        self._threads_set = True

    def copy_blocks(self, pairs: Seq[tuple[int, int]]) -> None:
        """Apply copy-on-write pairs from the block manager before the step that needs them."""
        if self.ranks is not None:
            self.ranks.copy("copy", list(pairs))
        dispatch.copy_blocks(self.kv_cache.tensor, list(pairs))

    @property
    def kv_caches(self) -> list[KVCache] | None:
        """Every tensor-parallel rank's KV cache, rank order, as this process sees them (rank
        0's own and the others' shared-memory pools); None where the others' are out of reach
        (their own devices). A runner without ranks: its one cache."""
        if self.ranks is None:
            return [self.kv_cache]
        others = self.ranks.kv_caches
        return None if others is None else [self.kv_cache, *others]

    def note_swaps(self, swaps: Seq[tuple[bool, Seq[tuple[int, int]]]]) -> None:
        """Swap copies (swap_in?, pairs) this rank's swapper was given, for the other
        tensor-parallel ranks to apply to their shards before the next forward."""
        if self.ranks is not None:
            for swap_in, pairs in swaps:
                self.ranks.copy("swap_in" if swap_in else "swap_out", list(pairs))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()

    def execute(self, batch: Seq[ScheduledSequence]) -> RunnerOutput:
        """Run one forward over `batch` and sample for every sequence whose chunk completes.

        Sequences are not updated here: the caller advances `num_computed_tokens` and appends
        the sampled tokens (so a failed step leaves every sequence as it was; only the seeded
        rows' generators have advanced, see `Sampler.save`).
        """
        return self.execute_with_logits(batch)[0]

    def execute_with_logits(
        self, batch: Seq[ScheduledSequence]
    ) -> tuple[RunnerOutput, torch.Tensor | None]:
        """`execute`, and beside its output the logits it sampled from: [num_sampled, vocab]
        float32, one row per sampled sequence in batch order (None when none was sampled)."""
        if not batch:
            return RunnerOutput(sampled=[]), None
        return self._execute(batch)

    def check_ranks(self) -> None:
        """RankLost if a tensor-parallel rank is gone (the worker loops call it while idle)."""
        if self.ranks is not None:
            self.ranks.check()

    def _execute(self, batch: Seq[ScheduledSequence]) -> tuple[RunnerOutput, torch.Tensor | None]:
        input_ids, positions, meta = self._prepare(batch)
        last_rows = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        sample_idx = [i for i, item in enumerate(batch) if item.completes and not item.draft]
        spec_idx = [i for i, item in enumerate(batch) if item.completes and item.draft]
        prompt_rows = prompt_logit_rows(batch)
        # NOTE: one logits call for the sampled rows, the verified rows (a speculating chunk's
        # last 1 + k) and the prompt-logprob rows (tensor-parallel ranks join the same gather)
        ends = last_rows.tolist()
        spec_rows = [r for i in spec_idx for r in range(ends[i] - len(batch[i].draft), ends[i] + 1)]
        logit_rows = [ends[i] for i in sample_idx] + spec_rows + prompt_rows.rows
        if self.ranks is not None:
            if not self._threads_set:
                self.set_threads(torch.get_num_threads())
            self.ranks.send(RankStepMessage(
                forward=True, token_ids=input_ids.tolist(), positions=positions.tolist(),
                slots=meta.slot_mapping.tolist(), block_tables=meta.block_tables.tolist(),
                logit_rows=logit_rows, query_lens=meta.query_lens,
                seq_lens=meta.seq_lens,
            ))  # fmt: skip
        try:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
            every = None
            if logit_rows:
                rows = torch.tensor(logit_rows, device=self.device)
                every = self.model.compute_logits(hidden[rows]).float()
        except Exception as exc:
            if self.ranks is None:
                raise
            # NOTE: the other ranks started this step: after a failure here they may wait in a
            # collective we never reach. A tensor-parallel forward is fail-stop: no retry.
            self.ranks.close()
            raise RankLost(f"tensor parallel step failed: {exc}") from exc
        n_sampled, n_verified = len(sample_idx), len(spec_rows)
        logits = every[:n_sampled] if every is not None and sample_idx else None
        output = self._sample(batch, logits, sample_idx)
        verified = every[n_sampled : n_sampled + n_verified] if every is not None else None
        emitted = self._verify(batch, verified, spec_idx, output) if spec_idx else None
        if every is not None and prompt_rows.rows:
            output.prompt_logprobs = prompt_logprobs(every[n_sampled + n_verified :], prompt_rows)
        return output, _in_batch_order(batch, logits, emitted, output)

    def _verify(
        self,
        batch: Seq[ScheduledSequence],
        logits: torch.Tensor | None,
        spec_idx: list[int],
        output: RunnerOutput,
    ) -> list[torch.Tensor]:
        """Verification of every speculating chunk (rows: its 1 + k verified positions, chunk
        after chunk; greedy: `accept_greedy`, sampled: `Sampler.verify_draft`): fills
        `output.sampled` and returns, per chunk, the logits rows of the tokens it emitted."""
        if logits is None:
            raise RuntimeError("runner: speculating chunks without verified logits")
        emitted_rows: list[torch.Tensor] = []
        start = 0
        for i in spec_idx:
            seq, draft = batch[i].seq, batch[i].draft
            rows = logits[start : start + len(draft) + 1]
            row = self._sampling_row(seq)
            if seq.params.structured_output is not None:
                rows = rows.clone()  # NOTE: the raw rows stay for the recorded logits
                self.sampler.mask_draft(rows, row, draft)
            if seq.params.greedy:
                tokens = accept_greedy(draft, greedy_tokens(rows).tolist())
            else:
                tokens = self.sampler.verify_draft(rows, row, draft)
            output.sampled[i] = SampledToken(tokens[0], None, extra=tokens[1:])
            emitted_rows.append(logits[start : start + len(tokens)])
            start += len(draft) + 1
        return emitted_rows

    def _sample(
        self, batch: Seq[ScheduledSequence], logits: torch.Tensor | None, sample_idx: list[int]
    ) -> RunnerOutput:
        sampled: list[SampledToken | None] = [None] * len(batch)
        if logits is not None:
            seqs = [batch[i].seq for i in sample_idx]
            beams = [j for j, seq in enumerate(seqs) if seq.params.use_beam_search]
            drawn = [j for j, seq in enumerate(seqs) if not seq.params.use_beam_search]
            tokens = self._draw([seqs[j] for j in drawn], logits[drawn] if beams else logits)
            tokens += self._beam_candidates([seqs[j] for j in beams], logits[beams])
            for j, token in zip([*drawn, *beams], tokens, strict=True):
                sampled[sample_idx[j]] = token
        return RunnerOutput(sampled=sampled)

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampledToken]:
        """One token per row through the sampler (and the first token of every other sample of
        a multi-sample request's first step)."""
        if not seqs:
            return []
        rows = [self._sampling_row(seq) for seq in seqs]
        # NOTE: a multi-sample request's first step draws every sample's first token from its
        # one logits row, each sample with its own generator (rows after the batch's)
        forks = [(j, k) for j, seq in enumerate(seqs) for k in self._forks(seq)]
        rows += [self._sampling_row(seqs[j], k) for j, k in forks]
        source = logits if not forks else logits[[*range(len(seqs)), *(j for j, _ in forks)]]
        out = self.sampler(source, rows)
        tokens = [SampledToken(out.token_ids[j], out.logprobs[j]) for j in range(len(seqs))]
        for r, (j, _) in enumerate(forks, start=len(seqs)):
            tokens[j].forks.append(SampledToken(out.token_ids[r], out.logprobs[r]))
        return tokens

    def _beam_candidates(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampledToken]:
        """Each beam's best continuations (token, logprob), as many as its search keeps
        (`BeamSearch.num_candidates`), from `log_softmax` of the float32 logits."""
        if not seqs:
            return []
        logprobs = torch.log_softmax(logits, dim=-1)
        width = min(
            max(beam_candidates_per_row(seq.params, self.config.eos_token_ids) for seq in seqs),
            logprobs.shape[-1],
        )
        values, ids = torch.topk(logprobs, width, dim=-1)
        out = []
        for seq, row_ids, row_values in zip(seqs, ids.tolist(), values.tolist(), strict=True):
            keep = min(beam_candidates_per_row(seq.params, self.config.eos_token_ids), width)
            candidates = list(zip(row_ids[:keep], row_values[:keep], strict=True))
            out.append(SampledToken(candidates[0][0], None, candidates=candidates))
        return out

    @staticmethod
    def _forks(seq: Sequence) -> range:
        return range(1, seq.params.num_samples) if seq.forks_pending else range(0)

    def _sampling_row(self, seq: Sequence, index: int = 0) -> SamplingRow:
        """The row of `seq`, or of its sample `index` (> 0: a fork's first token)."""
        if index == 0:
            return SamplingRow(
                request_id=seq.request_id,
                params=seq.params,
                prompt_token_ids=seq.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                eos_token_ids=self.config.eos_token_ids,
            )
        return SamplingRow(
            request_id=sample_request_id(seq.request_id, index),
            params=seq.params.for_sample(index),
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=(),
            eos_token_ids=self.config.eos_token_ids,
        )

    def _prepare(
        self, batch: Seq[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        chunks: list[Chunk] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            if item.num_new_tokens < 1 or end > seq.num_tokens:
                raise RuntimeError(f"{seq.request_id}: bad chunk {start}:{end} of {seq.num_tokens}")
            if item.draft and end != seq.num_tokens:
                raise RuntimeError(f"{seq.request_id}: proposals after a partial chunk")
            chunks.append((seq, start, [*seq.token_ids[start:end], *item.draft]))
        return model_inputs(chunks, self.device)


# A sequence, the position of its first token this step, and the tokens fed
Chunk = tuple[Sequence, int, list[int]]


def model_inputs(
    chunks: Seq[Chunk], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids, positions, metadata) of one forward over `chunks`, whose slots are in their
    sequences' block tables already."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for seq, start, fed in chunks:
        tokens += fed
        positions += range(start, start + len(fed))
        slots += seq.block_table.slot_mapping(start, start + len(fed))
    width = max(len(seq.block_table.block_ids) for seq, _, _ in chunks)
    tables = [seq.block_table.block_ids + [0] * (width - len(seq.block_table.block_ids))
              for seq, _, _ in chunks]  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
        query_lens=[len(fed) for _, _, fed in chunks],
        seq_lens=[start + len(fed) for _, start, fed in chunks],
    )
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return ids, pos, meta


def accept_greedy(draft: Seq[int], targets: Seq[int]) -> list[int]:
    """The tokens greedy decoding emits from one verification: the target's token after each
    accepted proposal, up to and including the first disagreement (`targets`: the argmax of
    each of the 1 + len(draft) positions, the last token's first)."""
    emitted = [targets[0]]
    for proposed, target in zip(draft, targets[1:], strict=True):
        if emitted[-1] != proposed:
            break
        emitted.append(target)
    return emitted


def _in_batch_order(
    batch: Seq[ScheduledSequence],
    sampled_logits: torch.Tensor | None,
    emitted: list[torch.Tensor] | None,
    output: RunnerOutput,
) -> torch.Tensor | None:
    """The logits of every emitted token, sequence by sequence in batch order (a speculating
    chunk: one row per token it emitted); the sampled rows alone when none speculated."""
    if emitted is None:
        return sampled_logits
    sampled_rows: Iterator[torch.Tensor] = iter(
        sampled_logits if sampled_logits is not None else []
    )
    spec_rows = iter(emitted)
    parts = []
    for item, token in zip(batch, output.sampled, strict=True):
        if token is None:
            continue
        parts.append(next(spec_rows) if item.draft else next(sampled_rows).unsqueeze(0))
    return torch.cat(parts) if parts else None


def _some(token: SampledToken | None) -> SampledToken:
    if token is None:
        raise RuntimeError("runner: a sampled row has no token")
    return token
