"""`SamplingParams`: how one request chooses its tokens, with vLLM's defaults and meanings.

Torch-free: the router builds and validates these before a request reaches any worker, and the
workers' `Sampler` (`pagedserve.model.sampler`) applies them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Literal, NoReturn

from pagedserve.errors import InvalidArgument

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for per token (OpenAI's API caps `top_logprobs` at 20)."""

MAX_STOP_STRINGS = 16
"""Most stop strings per request: each is searched in the text after every token."""

MAX_STOP_STRING_LEN = 256
"""Longest stop string in characters: the router holds back this much text before streaming it."""

MAX_SEED = 2**63
"""Seeds live in `[0, MAX_SEED)`, so they fit a signed int64 in every language and in protobuf."""

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this is greedy, as in vLLM (`_SAMPLING_EPS`): dividing by it is noise."""

MAX_ABS_PENALTY = 2.0
"""Presence and frequency penalties live in `[-MAX_ABS_PENALTY, MAX_ABS_PENALTY]` (OpenAI, vLLM)."""

DEFAULT_MAX_N = 16
"""Most samples (`best_of`, or `n`) of one request unless the router's `--max-n` says otherwise."""

MAX_GRAMMAR_CHARS = 65536
"""Longest structured-output spec (schema, regex, grammar, the choices together) in characters."""

MAX_CHOICES = 256
"""Most strings of a `choice` structured output."""

MAX_LOGIT_BIAS = 1024
"""Most entries of `logit_bias` (OpenAI allows 300 tokens; lm-eval-style uses send a handful)."""

MAX_BAD_WORDS = 64
"""Most `bad_words` per request (each becomes up to two token sequences)."""

MAX_BAD_WORD_TOKENS = 64
"""Longest token sequence of a bad word."""

MAX_ABS_LOGIT_BIAS = 100.0
"""Biases live in `[-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS]` (OpenAI)."""

GrammarKind = Literal["json_schema", "json", "regex", "choice", "grammar"]

_SEED_STRIDE = 0x9E3779B97F4A7C15  # NOTE: 2**64 / golden ratio: sample seeds far apart


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: `seed` itself for sample 0,
    `(seed + index * 0x9E3779B97F4A7C15) mod 2**63` for the others (docs/samples.md)."""
    return (seed + index * _SEED_STRIDE) % MAX_SEED


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow (docs/structured_output.md).

    `kind` says what `spec` holds: `json_schema` (the schema as JSON text), `json` (any JSON;
    `spec` empty), `regex`, `choice` (the strings in `choices`), `grammar` (GBNF, from rule
    `root`). `resumed_tokens`: for a stream moved to other workers, the prompt's last
    `resumed_tokens` tokens are output the grammar already accepted.
    """

    kind: GrammarKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    resumed_tokens: int = 0

    @property
    def field(self) -> str:
        """The field path errors about this spec name, e.g. `structured_output.regex`."""
        return f"structured_output.{self.kind}"

    def validate(self) -> None:
        """Raise `InvalidArgument` for what the router can tell is bad without compiling."""
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_GRAMMAR_CHARS:
            _fail(self.field, f"{size} characters, at most {MAX_GRAMMAR_CHARS}")
        if self.resumed_tokens < 0:
            _fail("structured_output.resumed_tokens", "must be >= 0")
        if self.kind == "json_schema":
            self._validate_schema()
        elif self.kind == "regex":
            self._validate_regex()
        elif self.kind == "choice":
            if not 0 < len(self.choices) <= MAX_CHOICES:
                _fail(self.field, f"1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                _fail(self.field, "every choice must be a non-empty string")
        elif self.kind == "grammar" and not self.spec.strip():
            _fail(self.field, "must not be empty")

    def _validate_schema(self) -> None:
        try:
            schema = json.loads(self.spec)
        except ValueError as e:
            _fail(self.field, f"not valid JSON: {e}")
        if not isinstance(schema, dict | bool):
            _fail(self.field, "a JSON schema is an object (or true / false)")

    def _validate_regex(self) -> None:
        if not self.spec:
            _fail(self.field, "must not be empty")
        try:
            re.compile(self.spec)
        except re.error as e:
            _fail(self.field, f"does not compile: {e}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings. Build freely; call `validate()` before using them.

    Defaults and meanings follow vLLM:
    - `temperature`: logits are divided by it; 0 (below `GREEDY_TEMPERATURE`) means greedy.
    - `top_p`: keep the smallest set of most likely tokens whose probability reaches `top_p`.
    - `top_k`: keep the `top_k` most likely tokens; 0 or -1 turns it off; 1 is greedy.
    - `min_p`: drop tokens less likely than `min_p` times the most likely token's probability.
    - `seed`: a seeded request draws from its own generator, so its tokens do not depend on what
      else is in the batch; `None` uses the worker's global RNG.
    - `max_tokens` / `min_tokens`: bounds on the number of generated tokens; until `min_tokens`
      are generated, eos (unless `ignore_eos`) and `stop_token_ids` cannot be sampled.
    - `stop`: strings that end generation (matched on detokenized text, by the router).
    - `stop_token_ids`: token ids that end generation (matched by the workers).
    - `ignore_eos`: keep generating after eos.
    - `repetition_penalty`: HF/CTRL semantics over prompt and output tokens; 1 is off.
    - `presence_penalty` / `frequency_penalty`: OpenAI semantics over output tokens; 0 is off.
    - `logprobs`: number of top logprobs returned per token; 0 returns only the sampled token's
      logprob; `None` returns none.
    - `skip_special_tokens`: leave special tokens out of the detokenized text.
    - `n`: samples returned for the prompt; `best_of` (>= n, None = n): samples generated, of
      which the n with the highest cumulative logprob are returned. The prompt is prefilled
      once and its KV blocks are shared by every sample (copy-on-write). Sample i of a seeded
      request draws from `sample_seed(seed, i)`.
    - `use_beam_search`: keep the `beam_width` (None: n) most likely continuations at every
      step and return the n best finished beams, scored as Hugging Face's `generate(num_beams=)`
      does: cumulative logprob / generated_len ** `length_penalty`, ended by its default
      `early_stopping=False` heuristic (docs/samples.md). Needs temperature 0 and no
      penalties, min_tokens, stop strings or logprobs.
    - `structured_output`: a grammar the output follows (`StructuredOutput`); tokens it does
      not allow are masked before sampling. Not with beam search, `ignore_eos` or `min_tokens`.
    - `logit_bias`: (token id, bias) pairs, sorted by id, added to the logits before sampling.
    - `allowed_token_ids`: only these may be sampled; empty allows every token.
    - `bad_words`: text the output must not contain; the router turns each into token
      sequences (`bad_word_ids`, with and without a leading space), and the sampler bans the
      token that would complete one after the output's last tokens.
    - `prompt_logprobs`: logprobs of each prompt token after the first given the tokens before
      it, with this many top alternatives (0: the token's own only); `None` returns none. A
      request with them takes no prefix-cache hit (every position is computed). Not with beam
      search.
    - `speculative`: False keeps the request out of speculative decoding on a decode worker
      that runs it (docs/speculative.md); the tokens do not depend on it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    structured_output: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: int | None = None
    speculative: bool = True  # False: never decoded speculatively (docs/speculative.md)

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: the beams of a beam search, else `best_of`,
        or `n` when it is None."""
        if self.use_beam_search:
            return self.beam_size
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_outputs(self) -> int:
        """Sequences returned: `n` (the best of `best_of`, or of the beams)."""
        return self.n

    @property
    def beam_size(self) -> int:
        """Beams of a beam search: `beam_width`, or `n` when it is None."""
        return self.beam_width if self.beam_width is not None else self.n

    def for_sample(self, index: int) -> SamplingParams:
        """The params sample `index` runs with: its own seed (see `sample_seed`)."""
        if index == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=sample_seed(self.seed, index))

    @property
    def greedy(self) -> bool:
        """True when the most likely token (after penalties) is always taken."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def changes_logits(self) -> bool:
        """True when a penalty, a bias or a token restriction changes the logits before a
        token is chosen (min_tokens aside: whether it bans a token depends on the output)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or bool(self.bad_word_ids)
        )

    def validate(
        self,
        *,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        prompt_len: int | None = None,
        max_n: int | None = None,
    ) -> None:
        """Raise `InvalidArgument` naming the first bad field (its bare name, e.g. `"top_p"`).

        `max_n` bounds the number of samples (`best_of`, or `n`).

        `vocab_size` enables the range check of `stop_token_ids`; `max_model_len` together with
        `prompt_len` checks that the prompt plus `max_tokens` fits the model (blamed on
        `max_tokens`: a caller that wants to blame an over-long prompt checks it first).
        Changes nothing.
        """
        self._validate_distribution()
        self._validate_lengths(max_model_len, prompt_len)
        self._validate_penalties()
        self._validate_stops(vocab_size)
        self._validate_outputs()
        self._validate_samples(max_n)
        self._validate_logits_controls(vocab_size, prompt_len)

    def _validate_logits_controls(self, vocab_size: int | None, prompt_len: int | None) -> None:
        self._validate_token_lists(vocab_size)
        grammar = self.structured_output
        if grammar is None:
            return
        grammar.validate()
        if prompt_len is not None and grammar.resumed_tokens > prompt_len:
            _fail("structured_output.resumed_tokens", f"more than the prompt's {prompt_len} tokens")
        off = {
            "use_beam_search": not self.use_beam_search,
            "ignore_eos": not self.ignore_eos,
            "min_tokens": self.min_tokens == 0,
            "allowed_token_ids": not self.allowed_token_ids,
        }
        for name, ok in off.items():
            if not ok:
                _fail(name, "not supported with structured_output (EOS ends the grammar)")

    def _validate_token_lists(self, vocab_size: int | None) -> None:
        upper = vocab_size if vocab_size is not None else math.inf
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < upper:
                _fail("logit_bias", f"token id {token_id} is outside [0, {upper})")
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                _fail("logit_bias", f"bias of token {token_id} must be in [-100, 100], got {bias}")
        for i, t in enumerate(self.allowed_token_ids):
            if not 0 <= t < upper:
                _fail("allowed_token_ids", f"allowed_token_ids[{i}]={t} is outside [0, {upper})")
        self._validate_bad_words(upper)

    def _validate_bad_words(self, upper: float) -> None:
        if len(self.bad_words) > MAX_BAD_WORDS:
            _fail("bad_words", f"at most {MAX_BAD_WORDS}, got {len(self.bad_words)}")
        for i, word in enumerate(self.bad_words):
            if not isinstance(word, str) or not 0 < len(word) <= MAX_STOP_STRING_LEN:
                _fail("bad_words", f"bad_words[{i}] must be 1-{MAX_STOP_STRING_LEN} characters")
        if len(self.bad_word_ids) > 2 * MAX_BAD_WORDS:
            _fail("bad_word_ids", f"at most {2 * MAX_BAD_WORDS} sequences")
        for i, ids in enumerate(self.bad_word_ids):
            if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS or not all(0 <= t < upper for t in ids):
                _fail("bad_word_ids", f"bad_word_ids[{i}]: 1-{MAX_BAD_WORD_TOKENS} ids in "
                      f"[0, {upper})")  # fmt: skip

    def _validate_samples(self, max_n: int | None) -> None:
        if self.n < 1:
            _fail("n", f"must be >= 1, got {self.n}")
        if self.use_beam_search:
            self._validate_beam_search()
        elif self.beam_width is not None:
            _fail("beam_width", "only used with use_beam_search")
        elif self.length_penalty != 1.0:
            _fail("length_penalty", "only used with use_beam_search")
        if self.best_of is not None and self.best_of < self.n:
            _fail("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        if max_n is not None and self.num_samples > max_n:
            which = "best_of" if self.best_of is not None and self.best_of > self.n else "n"
            which = "beam_width" if self.beam_width is not None and self.use_beam_search else which
            _fail(which, f"at most {max_n} samples per request, got {self.num_samples}")

    def _validate_beam_search(self) -> None:
        if self.temperature >= GREEDY_TEMPERATURE:
            _fail("temperature", f"must be 0 with use_beam_search, got {self.temperature}")
        if self.best_of is not None:
            _fail("best_of", "not used with use_beam_search (beam_width is)")
        if self.beam_width is not None and self.beam_width < 1:
            _fail("beam_width", f"must be >= 1, got {self.beam_width}")
        if self.n > self.beam_size:
            _fail("n", f"must be <= beam_width ({self.beam_size}), got {self.n}")
        if not math.isfinite(self.length_penalty):
            _fail("length_penalty", f"must be a finite number, got {self.length_penalty}")
        off = {
            "repetition_penalty": self.repetition_penalty == 1.0,
            "presence_penalty": self.presence_penalty == 0.0,
            "frequency_penalty": self.frequency_penalty == 0.0,
            "min_tokens": self.min_tokens == 0,
            "stop": not self.stop,
            "logprobs": self.logprobs is None,
            "prompt_logprobs": self.prompt_logprobs is None,
        }
        for name, ok in off.items():
            if not ok:
                _fail(name, "not supported with use_beam_search")

    def _validate_distribution(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            _fail("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            _fail("top_k", f"must be -1 or 0 (off) or a positive count, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            _fail("seed", f"must be in [0, 2**63), got {self.seed}")

    def _validate_lengths(self, max_model_len: int | None, prompt_len: int | None) -> None:
        if self.max_tokens < 1:
            _fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            _fail(
                "min_tokens",
                f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            )
        if (
            max_model_len is not None
            and prompt_len is not None
            and prompt_len + self.max_tokens > max_model_len
        ):
            _fail(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds "
                f"the model's context length of {max_model_len} tokens",
            )

    def _validate_penalties(self) -> None:
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            _fail(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                _fail(name, f"must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value}")

    def _validate_stops(self, vocab_size: int | None) -> None:
        if isinstance(self.stop, str):
            _fail("stop", "must be a sequence of strings, not one string")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                _fail("stop", f"stop[{i}] must be a non-empty string, got {s!r}")
            if len(s) > MAX_STOP_STRING_LEN:
                _fail("stop", f"stop[{i}] is {len(s)} characters, at most {MAX_STOP_STRING_LEN}")
        upper = vocab_size if vocab_size is not None else math.inf
        for i, t in enumerate(self.stop_token_ids):
            if not 0 <= t < upper:
                _fail("stop_token_ids", f"stop_token_ids[{i}]={t} is outside [0, {upper})")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _fail(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")


def _fail(field: str, description: str) -> NoReturn:
    raise InvalidArgument(field, description)
