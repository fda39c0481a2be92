"""`--warmup-prompts FILE`: text (one prompt a line) and JSON (strings and token-id lists)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagedserve.prefill_worker.warmup import load_warmup_prompts


def test_text_file_has_one_prompt_a_line_tokenized_like_a_request(tiny_llama, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("You are terse.\n\n  \nYou are verbose: explain.\n")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama), local_files_only=True)
    want = [tokenizer(t)["input_ids"] for t in ("You are terse.", "You are verbose: explain.")]
    assert load_warmup_prompts(path, tiny_llama) == want
    assert want[0][0] == tokenizer.bos_token_id


def test_json_file_mixes_strings_and_token_ids(tiny_llama, tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["two\nlines", [5, 6, 7]]))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama), local_files_only=True)
    assert load_warmup_prompts(path, tiny_llama) == [
        tokenizer("two\nlines")["input_ids"],
        [5, 6, 7],
    ]


@pytest.mark.parametrize("content", ['{"a": 1}', "[[1, -2]]", "[[]]", "[3]", "[[true]]"])
def test_malformed_json_is_a_value_error(tiny_llama, tmp_path, content):
    path = tmp_path / "prompts.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="warmup-prompts"):
        load_warmup_prompts(path, tiny_llama)
