"""`--warmup-prompts FILE`: the prompts a prefill worker puts in its prefix cache before READY.

Two formats, told apart by the file name:

- `*.json`: a JSON list whose items are strings (tokenized) or lists of token ids (used as they
  are), e.g. `["You are a helpful assistant.", [0, 412, 97]]`. Strings may hold newlines.
- anything else: UTF-8 text, one prompt a line; blank lines are skipped, a trailing newline is
  not part of the prompt.

Strings are tokenized with the model directory's tokenizer (`AutoTokenizer`, special tokens
added as for a request, e.g. a BOS), i.e. the ids the router sends for the same text; the blocks
of a warm-up prompt only help requests whose token ids start with exactly those ids.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_warmup_prompts(path: str | Path, model_dir: str | Path) -> list[list[int]]:
    """Token-id lists of the prompts in `path`. ValueError names a malformed file or item."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"warmup-prompts: {path} must hold a JSON list")
    else:
        items = [line for line in text.splitlines() if line.strip()]
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(_tokenize(texts, model_dir)) if texts else iter(())
    prompts: list[list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompts.append(next(encoded))
        elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
            prompts.append(list(item))
        else:
            raise ValueError(f"warmup-prompts: item {i} of {path} is not a string or token ids")
    return prompts


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tokenize(texts: list[str], model_dir: str | Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return [list(ids) for ids in tokenizer(texts)["input_ids"]]
