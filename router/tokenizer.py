"""The router's tokenizer: `tokenizers` only (no torch, no transformers), so the router starts
in well under a second (docs/router.md).

Reads `tokenizer.json` of a Hugging Face model directory; special token ids come from the
tokenizer's added tokens, eos ids from `config.json` and `generation_config.json`
(`pagedserve.generation_config`), the chat template from `chat_template.jinja` /
`tokenizer_config.json` (router/chat.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from pagedserve import generation_config
from pagedserve.router.chat import ChatTemplate
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the router knows about the model it fronts (GetModelInfo, validation)."""

    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    architecture: str
    dtype: str
    config: dict  # config.json as written (the block-hash fingerprint is computed over it)
    # generation_config.json's sampling values for the fields a request leaves unset
    sampling_defaults: dict[str, float]


class RouterTokenizer:
    """Encode prompts and decode token windows. Thread-safe (tokenizers releases the GIL)."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate | None = None) -> None:
        self._tok = tokenizer
        self.chat = chat if chat is not None else ChatTemplate(None)
        # the most input bytes one token can stand for; None: unbounded (see `min_tokens`)
        self.max_token_bytes = max_token_bytes(tokenizer)
        self.special_ids = frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        )

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, chat_template: str | None = None
    ) -> RouterTokenizer:
        """`chat_template`: the source of `--chat-template`, used instead of the model's."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no tokenizer.json in {model_dir}")
        chat = ChatTemplate.from_model_dir(model_dir, chat_template)
        return cls(Tokenizer.from_file(str(path)), chat)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary string of each id (transformers' `convert_ids_to_tokens`); ids must be
        below the vocabulary's size."""
        return [self._tok.id_to_token(token_id) or "" for token_id in token_ids]

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))`, in time linear in the text and no allocation
        beyond it: ceil(bytes / max_token_bytes), or 0 when the tokenizer gives no bound.

        NOTE: exact in the sense that matters: no text has fewer tokens, so a prompt refused by
        this bound could never have fit. It holds when every input byte reaches the BPE model
        (no normalizer or pre-tokenizer that drops or shrinks text) and no token stands for
        more bytes than its vocabulary string (no fused unknowns): `max_token_bytes`.
        """
        if self.max_token_bytes is None:
            return 0
        return -(-len(text.encode("utf-8")) // self.max_token_bytes)


_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"})
_SAFE_NORMALIZERS = frozenset({"Prepend", "Replace"})


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most input (UTF-8) bytes one token can cover, or None when no token count follows
    from the byte length (a normalizer or pre-tokenizer that can drop or shrink input, a model
    other than BPE, fused unknown tokens).

    Byte-level BPE: one vocabulary character per input byte. Otherwise a vocabulary string's
    UTF-8 length, which over-counts (`▁` for a space, `<0x41>` for one byte): safe. Added tokens
    match the raw text: their content's UTF-8 length.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    if not _keeps_every_byte(spec.get("normalizer"), _SAFE_NORMALIZERS):
        return None
    pre = spec.get("pre_tokenizer")
    if not _keeps_every_byte(pre, _SAFE_PRE_TOKENIZERS):
        return None
    byte_level = "ByteLevel" in json.dumps(pre)
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
    added = tokenizer.get_added_tokens_decoder().values()
    longest_added = max((len(a.content.encode()) for a in added), default=1)
    return max(longest, longest_added, 1)


def _keeps_every_byte(component: dict | None, safe: frozenset[str]) -> bool:
    """Whether a normalizer / pre-tokenizer (tokenizer.json form) never drops or shrinks text."""
    if component is None:
        return True
    kind = component.get("type")
    if kind == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return all(_keeps_every_byte(part, safe) for part in parts)
    if kind not in safe or component.get("behavior") == "Removed":
        return False
    if kind == "Replace":  # e.g. " " -> "▁": never shorter than what it replaces
        pattern = (component.get("pattern") or {}).get("String")
        content = component.get("content") or ""
        return pattern is not None and len(content.encode()) >= len(pattern.encode())
    return True


def read_model_card(
    model_dir: str | Path,
    name: str | None = None,
    *,
    max_model_len: int | None = None,
    use_generation_config: bool = True,
) -> ModelCard:
    """Read config.json and generation_config.json of a local model directory.

    `max_model_len`: the workers' `--max-model-len` (default: `max_position_embeddings`).
    `use_generation_config` False (`--generation-config none`): no sampling defaults; the eos
    ids of generation_config.json count either way. ValueError for sampling defaults that are
    not valid SamplingParams.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    config = json.loads(config_path.read_text())
    generation = generation_config.read_generation_config(model_dir)
    defaults = generation_config.sampling_defaults(generation) if use_generation_config else {}
    try:
        SamplingParams(**defaults).validate()  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"model: {generation_config.FILE} of {model_dir}: {exc}") from None
    return ModelCard(
        name=name or model_dir.resolve().name,
        vocab_size=int(config["vocab_size"]),
        max_model_len=max_model_len or int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=generation_config.eos_token_ids(config, generation),
        architecture=(config.get("architectures") or ["?"])[0],
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        config=config,
        sampling_defaults=defaults,
    )
