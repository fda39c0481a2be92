"""The router's tokenizer: `tokenizers` only (no torch, no transformers), so the router starts
in well under a second (DESIGN §1).

Reads `tokenizer.json` of a Hugging Face model directory; special token ids come from the
tokenizer's added tokens, eos ids from `generation_config.json` / `config.json`, the chat template
from `chat_template.jinja` / `tokenizer_config.json` (router/chat.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from pagedserve.router.chat import ChatTemplate


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


def read_model_card(model_dir: str | Path, name: str | None = None) -> ModelCard:
    """Read config.json (and generation_config.json) of a local model directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    config = json.loads(config_path.read_text())
    eos = config.get("eos_token_id")
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelCard(
        name=name or model_dir.resolve().name,
        vocab_size=int(config["vocab_size"]),
        max_model_len=int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        architecture=(config.get("architectures") or ["?"])[0],
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        config=config,
    )
