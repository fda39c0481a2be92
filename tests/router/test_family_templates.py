"""Each model family's chat template (tests/support/family_templates.py) renders in the router
as transformers' apply_chat_template renders it, token for token; where the template itself
refuses a conversation (Gemma 2's "System role not supported", Mistral's alternation rule), the
router refuses it too, as INVALID_ARGUMENT naming `messages.messages` with the template's reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from support.chat_templates import model_with_template
from support.family_templates import FAMILY_TEMPLATES
from transformers import AutoTokenizer

from pagedserve.errors import InvalidArgument
from pagedserve.router import convert
from pagedserve.router.tokenizer import RouterTokenizer, read_model_card
from pagedserve.v1 import generation_pb2

SYSTEM = {"role": "system", "content": "You answer in one word."}
USER = {"role": "user", "content": "  What is 2 + 2? Héllo ✓ <b>&</b> "}
ASSISTANT = {"role": "assistant", "content": "Four."}
THOUGHT = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."}
USER2 = {"role": "user", "content": "And 3 + 3?\nThanks"}
HISTORIES = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "system_user_assistant_user": [SYSTEM, USER, ASSISTANT, USER2],
    "user_assistant_user": [USER, ASSISTANT, USER2],
    "user_thought_user": [USER, THOUGHT, USER2],
    "user_thought": [USER, THOUGHT],
    "user_user": [USER, USER2],
}


@pytest.fixture(scope="module")
def family_dirs(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-templates")
    return {
        family: model_with_template(tiny_llama, root / family, template)
        for family, template in FAMILY_TEMPLATES.items()
    }


def router_ids(model_dir: Path, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    msg = generation_pb2.GenerateRequest(add_generation_prompt=add_generation_prompt)
    msg.messages.SetInParent()
    for m in messages:
        msg.messages.messages.add(role=m["role"], content=m["content"])
    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    return convert.router_request(msg, tokenizer, read_model_card(model_dir)).prompt_token_ids


def hf_ids(model_dir: Path, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    out = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("history", sorted(HISTORIES))
@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
def test_the_family_template_renders_as_transformers(family_dirs, family, history):
    model_dir, messages = family_dirs[family], HISTORIES[history]
    for add_generation_prompt in (True, False):
        try:
            want = hf_ids(model_dir, messages, add_generation_prompt)
        except TemplateError as refused:  # the template's own rule: the router applies it too
            with pytest.raises(InvalidArgument) as info:
                router_ids(model_dir, messages, add_generation_prompt)
            assert info.value.field == "messages.messages"
            assert str(refused) in info.value.description
            continue
        assert router_ids(model_dir, messages, add_generation_prompt) == want


def rendered(family_dirs, family: str, messages: list[dict]) -> str:
    tokenizer = RouterTokenizer.from_model_dir(family_dirs[family])
    return tokenizer.decode(router_ids(family_dirs[family], messages, True))


def test_gemma2_refuses_a_system_turn_and_gemma3_folds_it_into_the_first_user_turn(family_dirs):
    with pytest.raises(InvalidArgument, match="System role not supported"):
        router_ids(family_dirs["gemma2"], [SYSTEM, USER], True)
    text = rendered(family_dirs, "gemma3", [SYSTEM, USER, ASSISTANT, USER2])
    assert text.count("<start_of_turn>user\nYou answer in one word.\n\nWhat is 2 + 2?") == 1
    assert "<start_of_turn>model\nFour.<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_templates_that_insist_on_alternation_refuse_two_user_turns(family_dirs):
    for family in ("mistral", "gemma2", "gemma3"):
        with pytest.raises(InvalidArgument, match="alternate"):
            router_ids(family_dirs[family], [USER, USER2], True)


def test_qwen3_drops_the_reasoning_of_answers_before_the_last_user_turn(family_dirs):
    earlier = rendered(family_dirs, "qwen3", [USER, THOUGHT, USER2])
    assert "add them" not in earlier and "<|im_start|>assistant\nFour.<|im_end|>" in earlier
    last = rendered(family_dirs, "qwen3", [USER, THOUGHT])
    assert "<think>\nadd them\n</think>\n\nFour." in last
