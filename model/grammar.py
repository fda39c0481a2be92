"""`Grammars`: structured output for the sampler, on xgrammar (docs/structured_output.md).

A request with `SamplingParams.structured_output` gets a compiled grammar (compiled once per
distinct spec and kept, `compile`) and, per sequence, a matcher keyed like the sampler's
generators (`request_id`, a sample's own id). Before each sampling step `mask` brings every
constrained row's matcher up to the tokens that row has (its output, after the prompt tokens a
moved stream replays), fills all their next-token bitmasks in one call, and sets the logits of
every token the grammar does not allow to -inf. Nothing is accepted when a token is chosen: the
next step catches up from the sequence itself, so a step that failed, a swapped or recomputed
sequence, a fork and a stream that moved to this worker all find their matcher where their
tokens say (a matcher that is ahead, after a failed step, is rebuilt).

Once the grammar is complete, only the model's EOS ids are allowed: the request ends there.

xgrammar is imported on the first structured request, so workers that never see one never
load it (nor build its tokenizer tables, ~0.1 s for a 49k vocabulary).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.errors import InvalidArgument
from pagedserve.kernels import cpu_native
from pagedserve.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from pagedserve.model.sampler import SamplingRow

MAX_COMPILED = 256
"""Compiled grammars kept (least recently used dropped first)."""


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    key: tuple[str, str, tuple[str, ...]]
    accepted: int  # tokens it has taken


class Grammars:
    """One per sampler. `compile` may run on any thread; `mask` and `remove` on the sampler's."""

    def __init__(
        self, model_dir: Path | str, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: OrderedDict[tuple[str, str, tuple[str, ...]], Any] = OrderedDict()
        self._matchers: dict[str, _Matcher] = {}

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def compile(self, grammar: StructuredOutput) -> Any:
        """The compiled grammar of `grammar` (cached); InvalidArgument naming
        `structured_output.<kind>` when xgrammar cannot compile it."""
        key = (grammar.kind, grammar.spec, grammar.choices)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
            compiler = self._compiler_locked()
        try:
            compiled = _compile(compiler, grammar)
        except (RuntimeError, ValueError) as e:  # NOTE: xgrammar's parse errors are RuntimeError
            raise InvalidArgument(
                grammar.field, f"xgrammar cannot compile it: {_reason(e)}"
            ) from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compiler_locked(self) -> Any:
        if self._compiler is None:
            import xgrammar  # noqa: PLC0415  NOTE: only for workers that see a grammar
            from transformers import AutoTokenizer  # noqa: PLC0415

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError) as e:
                raise InvalidArgument(
                    "structured_output", f"this model's tokenizer does not load here: {e}"
                ) from None
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
            self._batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        return self._compiler

    def mask(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """Set, in place, the [B, V] float32 `logits` of what each constrained row's grammar does
        not allow to -inf; rows without a grammar are left alone."""
        import xgrammar  # noqa: PLC0415

        indices, matchers = [], []
        for i, row in enumerate(rows):
            grammar = row.params.structured_output
            if grammar is not None:
                indices.append(i)
                matchers.append(self._synced(row, grammar))
        if not indices:
            return
        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        # NOTE: ours (csrc/token_mask.c) where it can; xgrammar's CPU kernel took ~3 ms for
        # 16 x 49k, a tenth of a 16-row step of SmolLM2
        if not cpu_native.mask_logits(logits, bitmask, indices):
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)

    def mask_draft(self, logits: torch.Tensor, row: SamplingRow, draft: Sequence[int]) -> None:
        """Speculative decoding: set, in place, the [1 + k, V] float32 `logits` of one row's
        verified positions to -inf where its grammar refuses the token. Row i gets the mask
        after the row's tokens and the first i proposals; from the first proposal the grammar
        refuses on, later rows repeat that mask (they are never used: that proposal is
        rejected there). The matcher ends where it started (rolled back)."""
        import xgrammar  # noqa: PLC0415

        grammar = row.params.structured_output
        if grammar is None:
            raise ValueError(f"row: {row.request_id} has no structured_output")
        matcher = self._synced(row, grammar)
        rows = logits.shape[0]
        bitmask = xgrammar.allocate_token_bitmask(rows, logits.shape[1])
        taken = 0
        for i in range(rows):
            matcher.fill_next_token_bitmask(bitmask, i)
            if i == len(draft) or not _allowed(bitmask, i, draft[i]):
                bitmask[i + 1 :] = bitmask[i]
                break
            if not matcher.accept_token(draft[i]):
                raise RuntimeError(f"{row.request_id}: token {draft[i]} allowed yet refused")
            taken += 1
        if taken:
            matcher.rollback(taken)
        indices = list(range(rows))
        if not cpu_native.mask_logits(logits, bitmask, indices):
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)

    def _synced(self, row: SamplingRow, grammar: StructuredOutput) -> Any:
        """The row's matcher, having accepted exactly the row's tokens."""
        replay = grammar.resumed_tokens
        prompt, output = row.prompt_token_ids, row.output_token_ids
        key = (grammar.kind, grammar.spec, grammar.choices)
        state = self._matchers.get(row.request_id)
        if state is None or state.key != key or state.accepted > replay + len(output):
            import xgrammar  # noqa: PLC0415

            state = _Matcher(xgrammar.GrammarMatcher(self.compile(grammar)), key, 0)
            self._matchers[row.request_id] = state
        # NOTE: only the tokens it has not taken (usually one): no copy of the whole output
        start = state.accepted
        replayed = prompt[len(prompt) - replay + start :] if start < replay else ()
        for token in [*replayed, *output[max(start - replay, 0) :]]:
            if not state.matcher.accept_token(token):
                raise RuntimeError(
                    f"{row.request_id}: token {token} breaks its grammar after {state.accepted} "
                    "tokens (it was sampled under the grammar's mask)"
                )
            state.accepted += 1
        return state.matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether bit `token` of `bitmask` row `row` (xgrammar's packed int32 words) is set."""
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _compile(compiler: Any, grammar: StructuredOutput) -> Any:
    if grammar.kind == "json_schema":
        # NOTE: compact JSON (no free whitespace): small models otherwise loop on spaces
        return compiler.compile_json_schema(grammar.spec, any_whitespace=False, strict_mode=True)
    if grammar.kind == "json":  # NOTE: a JSON object, compact for the same reason
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)  # fmt: skip
    if grammar.kind == "regex":
        return compiler.compile_regex(grammar.spec)
    if grammar.kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in grammar.choices)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    return compiler.compile_grammar(grammar.spec)


def _reason(error: Exception) -> str:
    """xgrammar's message without its `[time] file.cc:line:` prefix."""
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and ".cc:" in head else text
