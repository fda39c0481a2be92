"""`Sampler`: turns the last-position logits of a batch into one token (and logprobs) per row.

Per row, in the order vLLM and Hugging Face use:

    raw logits ─► grammar mask (structured output: tokens it does not allow → -inf)
        │
        ├─► logprobs (log_softmax of these RAW logits: vLLM's default "raw_logprobs")
        │
        ├─► min_tokens (eos / stop ids → -inf) ─► allowed_token_ids ─► bad_words ─► logit_bias
        ├─► repetition ─► frequency + presence penalties
        │
        ├─ greedy row:  argmax (lowest index on ties)
        └─ other rows:  / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► multinomial

Filters follow `transformers`' warpers exactly (`TopKLogitsWarper` keeps ties with the k-th
value, `TopPLogitsWarper`, `MinPLogitsWarper`) and always keep at least one token.

Seeds: the sampler owns one `torch.Generator` per seeded request, keyed by request id, created
from the seed when the request is first sampled and dropped by `remove` when it finishes or is
aborted. So a seeded request draws the same tokens whatever else shares its batches; a worker
that re-runs a failed step saves and restores the generators around it (`save` / `restore`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedserve.errors import InvalidArgument
from pagedserve.model.grammar import Grammars
from pagedserve.model.requests.batch import TokenLogprobs
from pagedserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# top-p: heads of the sorted distribution tried before the whole of it (`apply_top_p`)
TOP_P_HEADS = (256, 4096)
DRAW_BLOCK = 256  # tokens summed at once when a row is sampled (`draw_rows`)
# NOTE: below this temperature a row's probabilities reach float32's denormals (an LM's logits
# span ~50, and e^(-50 / 0.5) < 1e-38), where each operation costs ~10x: 64 rows of SmolLM2's
# softmax took 9.6 ms at 0.2 against 0.95 at 0.5. float64 holds them, 3 ms at any temperature
COLD_TEMPERATURE = 0.5


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the batch. Read, never mutated.

    `request_id` keys the request's generator when `params.seed` is set: the sampler advances
    it by one draw per sampled (non-greedy) step, for the request's whole life.
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SamplerOutput:
    """One entry per row, in row order; `logprobs[i]` is None when row i asked for none."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax ([B, V] -> [B] int64): the lowest index among equal maxima, a NaN's
    index where the row has one, as `argmax(dim=-1)` gives.

    NOTE: on CPU `max(dim=-1)` finds the same index 3.4x faster than `argmax` (torch 2.13, a
    49,152-entry vocabulary: 1.8 against 6.0 ms for 64 rows on one thread, 1.5 % of such a
    decode step); elsewhere `argmax` as it is."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request's whole life, on the device the logits live on."""
    return torch.Generator(device=device).manual_seed(seed)


# A request's generator state before a step, or None when it had no generator yet.
GeneratorStates = dict[str, torch.Tensor | None]


class Sampler:
    """One instance per model runner; owns the seeded requests' generators and the structured
    requests' grammar matchers (`grammars`: None where the model has no tokenizer to build them
    from, which refuses structured requests), nothing else.

    Never mutates `logits` or `rows`. Not thread-safe: call it from the runner's thread.
    """

    def __init__(self, grammars: Grammars | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Choose one token per row of `logits` ([B, V], any float dtype) for `rows` (len B)."""
        _check_batch(logits, rows)
        raw = logits.float()
        if any(row.params.structured_output is not None for row in rows):
            raw = raw.clone() if raw is logits else raw
            self._grammars().mask(raw, rows)
        if all(_is_plain_greedy(row) for row in rows):
            token_ids = greedy_tokens(raw)
        else:
            generators = [self._generator(row, raw.device) for row in rows]
            token_ids = _choose(self.processed_logits(raw, rows), rows, generators)
        return SamplerOutput(token_ids.tolist(), _logprobs(raw, token_ids, rows))

    def _generator(self, row: SamplingRow, device: torch.device) -> torch.Generator | None:
        """The row's own generator (created from its seed on first use), or None: global RNG."""
        seed = row.params.seed
        if seed is None or row.params.greedy:
            return None
        generator = self._generators.get(row.request_id)
        if generator is None:
            generator = make_generator(seed, device)
            self._generators[row.request_id] = generator
        return generator

    def remove(self, request_id: str) -> None:
        """Drop the request's generator and grammar matcher (it finished or was aborted); a
        no-op if it has none."""
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.remove(request_id)

    def check(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (cached), so that a bad one is refused when the
        request arrives: InvalidArgument naming `structured_output.<kind>`."""
        if params.structured_output is not None:
            self._grammars().compile(params.structured_output)

    def mask_draft(self, logits: torch.Tensor, row: SamplingRow, draft: Sequence[int]) -> None:
        """A structured row's verified positions masked by its grammar (`Grammars.mask_draft`)."""
        self._grammars().mask_draft(logits, row, draft)

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            raise InvalidArgument("structured_output", "not available on this worker's model")
        return self.grammars

    def save(self, request_ids: Iterable[str]) -> GeneratorStates:
        """The generator state of each request, to undo the draws of a step that failed."""
        return {
            rid: gen.get_state() if (gen := self._generators.get(rid)) is not None else None
            for rid in request_ids
        }

    def restore(self, states: GeneratorStates) -> None:
        """Put back generators as `save` found them (a request without one then loses it)."""
        for request_id, state in states.items():
            if state is None:
                self._generators.pop(request_id, None)
            elif (generator := self._generators.get(request_id)) is not None:
                generator.set_state(state)

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def verify_draft(
        self, logits: torch.Tensor, row: SamplingRow, draft: Sequence[int]
    ) -> list[int]:
        """Speculative decoding's rejection sampling for one sampled row whose logits no
        penalty changes: `logits` [1 + k, V] are the raw logits after its last token and after
        each proposal `draft` (k tokens). Returns the tokens it emits: the accepted proposals,
        then one drawn token. Each emitted token follows the row's own distribution exactly.

        A proposal is a single token (the draft's distribution q puts all its mass on it), so
        the rule `accept with min(1, p/q)`, else draw from `norm(max(0, p - q))`, becomes:
        accept d with probability p(d), else draw from p without d; after k acceptances, draw
        the next token from the last row. Draws use the request's generator when seeded.
        """
        params = [row.params] * logits.shape[0]
        probs = _warp(logits.float(), params).softmax(dim=-1, dtype=_probability_dtype(params))
        generator = self._generator(row, logits.device)
        emitted: list[int] = []
        for i, proposed in enumerate(draft):
            p = probs[i]
            u = torch.rand((), device=p.device, generator=generator)
            if u < p[proposed]:
                emitted.append(proposed)
                continue
            residual = p.clone()
            residual[proposed] = 0.0
            return [*emitted, _draw(residual, generator)]
        return [*emitted, _draw(probs[len(draft)], generator)]

    def processed_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The float32 logits each row's token is chosen from, as a new [B, V] tensor.

        Greedy rows: after min_tokens and penalties (argmax of this is the token). Other rows:
        also after temperature, top-k, top-p and min-p; filtered tokens are -inf.
        """
        _check_batch(logits, rows)
        penalized = [i for i, row in enumerate(rows) if _has_penalties(row)]
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not penalized and len(sampled) == len(rows):  # NOTE: the warp's is the new tensor
            return _warp(logits.float(), [row.params for row in rows], owned=False)
        out = logits.to(torch.float32, copy=True)
        for i in penalized:
            _apply_penalties(out[i], rows[i])
        if len(sampled) == len(rows):  # NOTE: no gather and scatter back when every row samples
            out = _warp(out, [row.params for row in rows])
        elif sampled:
            index = torch.tensor(sampled, device=out.device)
            out[index] = _warp(out[index], [rows[i].params for i in sampled])
        return out


def _check_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits: expected a float [B, V] tensor, got {logits.dtype} {logits.shape}"
        )
    if logits.shape[0] != len(rows):
        raise ValueError(f"rows: {len(rows)} rows for {logits.shape[0]} rows of logits")


def _min_tokens_banned(row: SamplingRow) -> list[int]:
    """Token ids that may not be sampled yet because `min_tokens` is not reached."""
    params = row.params
    if len(row.output_token_ids) >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else row.eos_token_ids
    return [*eos, *params.stop_token_ids]


def _has_penalties(row: SamplingRow) -> bool:
    return row.params.changes_logits or bool(_min_tokens_banned(row))


def _is_plain_greedy(row: SamplingRow) -> bool:
    return row.params.greedy and not _has_penalties(row)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """Apply min_tokens, allowed_token_ids, bad words, logit_bias, repetition, frequency and
    presence penalties in place to one [V] row. Where min_tokens and allowed_token_ids together
    leave no token, the allowed ones stay (min_tokens yields); bad words yield the same way."""
    p = row.params
    vocab_size = logits.shape[0]
    if p.allowed_token_ids:
        allowed = _ids(p.allowed_token_ids, vocab_size, logits.device)
        kept = logits[allowed]
        logits.fill_(_NEG_INF)
        logits[allowed] = kept
    banned = _min_tokens_banned(row)
    if banned:
        before = logits.clone() if p.allowed_token_ids else None
        logits[_ids(banned, vocab_size, logits.device)] = _NEG_INF
        if before is not None and bool(torch.isneginf(logits).all()):
            logits.copy_(before)
    banned_words = _bad_word_bans(p.bad_word_ids, row.output_token_ids)
    if banned_words:
        kept = logits.clone()
        logits[_ids(banned_words, vocab_size, logits.device)] = _NEG_INF
        if bool(torch.isneginf(logits).all()):  # NOTE: nothing left (a grammar's one token)
            logits.copy_(kept)
    pairs = [(t, b) for t, b in p.logit_bias if 0 <= t < vocab_size]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        bias = torch.tensor([b for _, b in pairs], dtype=logits.dtype)
        logits[ids.to(logits.device)] += bias.to(logits.device)
    if p.repetition_penalty != 1.0:
        seen = _ids([*row.prompt_token_ids, *row.output_token_ids], vocab_size, logits.device)
        # NOTE: HF/CTRL semantics: dividing a negative logit would *raise* it, so multiply.
        values = logits[seen]
        penalty = p.repetition_penalty
        logits[seen] = torch.where(values < 0, values * penalty, values / penalty)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        # NOTE: only the tokens the output holds: a count over the whole vocabulary and its
        # passes cost ~0.15 ms a row of 49,152 tokens; the same arithmetic for each token
        output = _ids(row.output_token_ids, vocab_size, logits.device)
        ids, counts = torch.unique(output, return_counts=True)
        counts = counts.to(torch.float32)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty * torch.ones_like(counts)


def _bad_word_bans(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of each bad-word sequence whose other tokens end the output (vLLM's
    NoBadWords rule: a one-token word is always banned)."""
    banned = []
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (
            len(output) >= head and list(output[len(output) - head :]) == list(seq[:-1])
        ):
            banned.append(seq[-1])
    return banned


def _ids(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Token ids as a long tensor, dropping ids the logits have no column for (as HF does)."""
    # NOTE: filtered on the host so that a GPU run does not sync on a boolean mask.
    ids = torch.tensor(token_ids, dtype=torch.long)
    return ids[(ids >= 0) & (ids < vocab_size)].to(device, non_blocking=True)


def _warp(logits: torch.Tensor, params: list[SamplingParams], owned: bool = True) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, on a [N, V] block of non-greedy rows: a new
    tensor, unless `logits` is `owned` (the caller's own copy) and nothing changes it."""
    warped = logits
    if any(p.temperature != 1.0 for p in params):
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        warped = warped / temperature.unsqueeze(1)
    if any(0 < p.top_k < logits.shape[1] for p in params):
        warped = apply_top_k(warped, [p.top_k for p in params])
    dtype = _probability_dtype(params)
    if any(p.top_p < 1.0 for p in params):
        warped = apply_top_p(warped, [p.top_p for p in params], dtype)
    if any(p.min_p > 0.0 for p in params):
        warped = apply_min_p(warped, [p.min_p for p in params], dtype)
    return warped.clone() if warped is logits and not owned else warped


def _probability_dtype(params: Sequence[SamplingParams]) -> torch.dtype:
    """What a block of rows' softmax computes in: float64 when one is cold (COLD_TEMPERATURE)."""
    cold = any(p.temperature < COLD_TEMPERATURE for p in params)
    return torch.float64 if cold else torch.float32


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Keep, per row, the tokens at least as likely as the k-th most likely; -inf the rest.

    `top_k[i]` <= 0 or >= V leaves row i untouched. Returns a new tensor.

    NOTE: the output is built from the k largest (one `topk`, one scatter into -inf) instead
    of comparing every logit with the k-th: 7.6 -> ~3 ms for 64 rows of 49,152 at k = 40. A
    row whose (k+1)-th largest equals its k-th has ties the scatter would drop (transformers
    keeps them), and a row with no top-k is copied: those rows take the comparison.
    """
    vocab_size = logits.shape[1]
    active = [0 < k < vocab_size for k in top_k]
    take = max((k for k, on in zip(top_k, active, strict=True) if on), default=0) + 1
    ks = torch.tensor([k if on else 1 for k, on in zip(top_k, active, strict=True)])
    ks = ks.to(logits.device)[:, None]
    on = torch.tensor(active, device=logits.device)[:, None]
    values, indices = torch.topk(logits, min(take, vocab_size), dim=-1)
    kth = values.gather(1, ks - 1)
    if logits.device.type != "cpu":  # NOTE: choosing the rows to compare would sync a GPU
        return logits.masked_fill(on & (logits < kth), _NEG_INF)
    ties = values.gather(1, ks.clamp(max=values.shape[1] - 1)) == kth
    compare = (~on | ties | kth.isnan()).flatten().nonzero().flatten()
    keep = torch.arange(values.shape[1], device=logits.device)[None, :] < ks
    out = torch.full_like(logits, _NEG_INF)
    out.scatter_(1, indices, values.masked_fill(~keep, _NEG_INF))
    if compare.numel():
        rows, edge = logits[compare], kth[compare]
        out[compare] = rows.masked_fill(on[compare] & (rows < edge), _NEG_INF)
    return out


def apply_top_p(
    logits: torch.Tensor, top_p: Sequence[float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Keep, per row, the most likely tokens until their probability reaches `top_p[i]`.

    As `TopPLogitsWarper`: drop tokens whose ascending cumulative probability is <= 1 - top_p,
    never the most likely one. `top_p[i]` >= 1 leaves row i untouched. Returns a new tensor.
    `dtype`: the probabilities' (`_probability_dtype`).

    NOTE: a token is kept when the probability of the tokens above it is below top_p, so only
    the head of the order matters: a row is decided from its `TOP_P_HEADS` most likely tokens
    when those reach top_p (a top-k costs a tenth of a sort of 49,152 logits), else from a
    longer head or, at last, the whole sorted row.
    """
    p = torch.tensor(top_p, dtype=torch.float32, device=logits.device).double()
    filtered = [i for i, value in enumerate(top_p) if value < 1]
    if not filtered:
        return logits.clone()
    pending = torch.tensor(filtered, device=logits.device)
    every = len(filtered) == len(top_p)
    # NOTE: the filtered rows' kept tokens are put back below
    out = torch.full_like(logits, _NEG_INF) if every else logits.index_fill(0, pending, _NEG_INF)
    probs = (logits if every else logits[pending]).softmax(dim=-1, dtype=dtype)
    # NOTE: a float64 sum: a float32 one (off by ~1e-7) moved the boundary at top-p 0.99+
    total = probs.sum(dim=-1, dtype=torch.float64)
    vocab = logits.shape[1]
    heads = TOP_P_HEADS if logits.device.type == "cpu" else ()  # NOTE: a GPU sorts fast
    for head in (*(h for h in heads if h < vocab), vocab):
        whole = head == vocab
        top, order = torch.sort(probs, descending=True) if whole else torch.topk(probs, head)
        # NOTE: in float64 and over the row's own total: float32 softmax's rows sum to 1 only
        # within ~1e-5, enough to move the boundary token in a few rows in a hundred
        top = top.double() / total[:, None]
        above = top.cumsum(dim=-1) - top  # the mass of the tokens before each
        kept = above < p[pending, None]
        kept[:, 0] = True
        decided = (
            torch.ones_like(total, dtype=torch.bool) if whole else top.sum(dim=-1) >= p[pending]
        )
        rows, columns = pending[decided, None], order[decided]
        out[rows, columns] = logits[rows, columns].masked_fill(~kept[decided], _NEG_INF)
        pending, probs, total = pending[~decided], probs[~decided], total[~decided]
        if len(pending) == 0:
            break
    return out


def apply_min_p(
    logits: torch.Tensor, min_p: Sequence[float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Drop, per row, tokens less likely than `min_p[i]` x the most likely token's probability.

    The most likely token always stays (`min_p` <= 1). Returns a new tensor.
    """
    m = torch.tensor(min_p, dtype=torch.float32, device=logits.device)[:, None]
    probs = logits.softmax(dim=-1, dtype=dtype)
    # NOTE: one pass from probs and logits, where a mask then masked_fill made two (64 rows of
    # 49,152: 4.9 -> 3.8 ms)
    return torch.where(probs < m * probs.amax(dim=-1, keepdim=True), _NEG_INF, logits)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized non-negative `weights` [V]."""
    u = torch.rand(1, device=weights.device, generator=generator)
    return int(draw_rows(weights[None], u)[0])


def draw_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalized non-negative `weights` [N, V], by inverting each row's
    cumulative distribution at its `uniforms` [N] value in [0, 1): the first token whose
    cumulative weight exceeds u x the row's total. A token of weight 0 is never drawn; a
    token's share is its weight to the rounding of a float64 running sum.

    NOTE: `torch.multinomial` draws a random number per token (on CPU ~16 ns each: 62 ms for
    64 rows of a 49,152-token vocabulary, a third of such a decode step); this draws one a row.
    And it sums blocks of `DRAW_BLOCK` tokens, then runs through one block, where a running
    sum over the whole row was one sequential pass (64 rows: 1.0 -> 0.4 ms)."""
    n, vocab = weights.shape
    whole = vocab - vocab % DRAW_BLOCK
    sums = weights[:, :whole].view(n, -1, DRAW_BLOCK).sum(dim=-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    cumulative = sums.double().cumsum(dim=-1)
    target = uniforms.to(torch.float64)[:, None] * cumulative[:, -1:]
    block = torch.searchsorted(cumulative, target, right=True).clamp_(max=sums.shape[1] - 1)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    local = weights.gather(1, columns.clamp(max=vocab - 1)).to(torch.float64)
    local.masked_fill_(columns >= vocab, 0.0)
    at = torch.searchsorted(local.cumsum(dim=-1) + before, target, right=True)
    tokens = columns.gather(1, at.clamp(max=DRAW_BLOCK - 1)).squeeze(1)
    # NOTE: past the block: u x total rounded up to the total, or a block's float32 sum above
    # its float64 running sum (rare rows: drawn again over the whole row)
    missed = (at.squeeze(1) >= DRAW_BLOCK) | (tokens >= vocab)
    if bool(missed.any()):
        tokens[missed] = _draw_over_rows(weights[missed], target[missed])
    return tokens


def _draw_over_rows(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`draw_rows` by one running sum over each whole row: the first token whose float64
    cumulative weight exceeds `target` [N, 1], else the row's last token of non-zero weight."""
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    tokens = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    last = weights.shape[1] - 1 - (weights.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.where(tokens >= weights.shape[1], last, tokens)


def _choose(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Greedy rows take the argmax, others draw from softmax with their own generator."""
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled:
        return greedy_tokens(logits)
    every = len(sampled) == len(rows)
    index = torch.tensor(sampled, device=logits.device)
    # NOTE: softmax, not exp(x - max): torch's exp is ~6x slower on -inf (filtered tokens)
    dtype = _probability_dtype([rows[i].params for i in sampled])
    probs = (logits if every else logits[index]).softmax(dim=-1, dtype=dtype)
    # NOTE: one uniform a row: unseeded rows from the global generator in one call, a seeded
    # row from its own (so its draws never depend on what else is batched)
    uniforms = torch.empty(len(sampled), device=logits.device)
    unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), device=logits.device)
    for j, i in enumerate(sampled):
        if (generator := generators[i]) is not None:
            uniforms[j] = torch.rand(1, device=logits.device, generator=generator)[0]
    drawn = draw_rows(probs, uniforms)
    if every:
        return drawn
    token_ids = greedy_tokens(logits)
    token_ids[index] = drawn
    return token_ids


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[TokenLogprobs | None]:
    """Raw logprobs of the chosen tokens for the rows that asked; one device sync in all."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)
    chosen = token_ids[index][:, None]
    chosen_logprob = logprobs.gather(1, chosen)
    rank = (logprobs >= chosen_logprob).sum(dim=-1)
    num_top = min(max(rows[i].params.logprobs or 0 for i in wanted), raw.shape[1])
    top = torch.topk(logprobs, num_top, dim=-1)
    lists = (chosen.squeeze(1), chosen_logprob.squeeze(1), rank, top.indices, top.values)
    ids, lps, ranks, top_ids, top_lps = (t.tolist() for t in lists)
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs or 0
        pairs = list(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
        result[i] = TokenLogprobs(ids[j], lps[j], ranks[j], pairs)
    return result
