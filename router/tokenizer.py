"""The router's tokenizer: `tokenizers` only (no torch, no transformers), so the router starts
in well under a second (DESIGN §1).

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
        self.special_ids = frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> RouterTokenizer:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no tokenizer.json in {model_dir}")
        return cls(Tokenizer.from_file(str(path)), ChatTemplate.from_model_dir(model_dir))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


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
