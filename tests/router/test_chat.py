"""Chat prompts: the router's rendering equals transformers' apply_chat_template token for token,
and bad conversations are INVALID_ARGUMENT naming the field (router/chat.py, router/convert.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.chat_templates import CHATML, STRICT, TOOLKIT, model_with_template
from support.smollm2 import smollm2_dir
from transformers import AutoTokenizer

from pagedserve.errors import InvalidArgument
from pagedserve.router import convert
from pagedserve.router.chat import ChatMessage, ChatTemplate
from pagedserve.router.tokenizer import RouterTokenizer, read_model_card
from pagedserve.v1 import generation_pb2

SYSTEM = {"role": "system", "content": "You answer in one word."}
USER = {"role": "user", "content": "  What is 2 + 2? Héllo ✓ <b>&</b> "}
ASSISTANT = {"role": "assistant", "content": "Four."}
USER2 = {"role": "user", "content": "And </s> 3 + 3?\nThanks"}
HISTORIES = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "system_user_assistant_user": [SYSTEM, USER, ASSISTANT, USER2],
    "user_assistant_user": [USER, ASSISTANT, USER2],
    "user_assistant": [USER, ASSISTANT],
    "empty_content": [USER, {"role": "assistant", "content": ""}, USER2],
}


@pytest.fixture(scope="module")
def model_dirs(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    dirs = {
        "chatml": model_with_template(tiny_llama, root / "chatml", CHATML),
        "strict": model_with_template(tiny_llama, root / "strict", STRICT, as_jinja_file=True),
        "toolkit": model_with_template(tiny_llama, root / "toolkit", TOOLKIT),
        "none": model_with_template(tiny_llama, root / "none", None),
    }
    return dirs


def request(messages: list[dict], add_generation_prompt: bool | None = None):
    msg = generation_pb2.GenerateRequest()
    msg.messages.SetInParent()
    for m in messages:
        msg.messages.messages.add(role=m["role"], content=m["content"])
    if add_generation_prompt is not None:
        msg.add_generation_prompt = add_generation_prompt
    return msg


def router_ids(model_dir: Path, messages: list[dict], add_generation_prompt=None) -> list[int]:
    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    card = read_model_card(model_dir)
    msg = request(messages, add_generation_prompt)
    return convert.router_request(msg, tokenizer, card).prompt_token_ids


def hf_ids(model_dir: Path, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    out = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("history", sorted(HISTORIES))
@pytest.mark.parametrize("template", ["chatml", "strict", "toolkit", "smollm2"])
def test_chat_prompt_equals_transformers_apply_chat_template(model_dirs, template, history):
    # NOTE: the real model's own template: converted once (skips off CI without the wheel)
    model_dir = smollm2_dir() if template == "smollm2" else model_dirs[template]
    messages = HISTORIES[history]
    if template == "strict" and history == "empty_content":
        messages = [USER, ASSISTANT, USER2]
    want = hf_ids(model_dir, messages, add_generation_prompt=True)
    assert router_ids(model_dir, messages) == want  # unset add_generation_prompt: true
    assert router_ids(model_dir, messages, True) == want
    without = hf_ids(model_dir, messages, add_generation_prompt=False)
    assert router_ids(model_dir, messages, False) == without
    assert without != want


def test_the_template_writes_bos_once(model_dirs):
    ids = router_ids(model_dirs["strict"], [USER])
    bos = RouterTokenizer.from_model_dir(model_dirs["strict"]).encode("", add_special_tokens=True)
    assert bos and ids[: len(bos)] == bos and ids[len(bos)] != bos[0]


def test_chat_template_jinja_file_wins_over_tokenizer_config(model_dirs, tmp_path):
    model_dir = model_with_template(model_dirs["chatml"], tmp_path / "both", STRICT,
                                    as_jinja_file=True)  # fmt: skip
    assert "chat_template" in (model_dir / "tokenizer_config.json").read_text()
    assert router_ids(model_dir, [USER]) == hf_ids(model_dir, [USER], True)
    assert ChatTemplate.from_model_dir(model_dir).source == STRICT


def field_of(call) -> str:
    with pytest.raises(InvalidArgument) as info:
        call()
    return info.value.field


def test_bad_conversations_name_their_field(model_dirs):
    chatml, strict = model_dirs["chatml"], model_dirs["strict"]
    assert field_of(lambda: router_ids(chatml, [])) == "messages.messages"
    bad_role = [USER, {"role": "robot", "content": "beep"}]
    assert field_of(lambda: router_ids(chatml, bad_role)) == "messages.messages[1].role"
    # a known role that this template refuses (raise_exception): the conversation is bad
    tool = [USER, {"role": "tool", "content": "42"}]
    assert field_of(lambda: router_ids(strict, tool)) == "messages.messages"
    assert field_of(lambda: router_ids(model_dirs["none"], [USER])) == "messages"
    chat = RouterTokenizer.from_model_dir(chatml).chat
    bad_content = [ChatMessage("user", 3)]  # type: ignore[arg-type]
    assert field_of(lambda: chat.render(bad_content, add_generation_prompt=True)) == (
        "messages[0].content"
    )
    with pytest.raises(TypeError):  # and the wire type makes it impossible from a client
        generation_pb2.ChatMessage(role="user", content=3)  # type: ignore[arg-type]


def test_a_template_error_names_messages_and_says_why(model_dirs):
    with pytest.raises(InvalidArgument) as info:
        router_ids(model_dirs["strict"], [USER, {"role": "tool", "content": "x"}])
    assert "Roles must be user or assistant, got tool" in info.value.description


def test_a_template_that_does_not_compile_is_unavailable_not_fatal(tiny_llama, tmp_path):
    model_dir = model_with_template(tiny_llama, tmp_path / "broken", "{% for m in messages %}")
    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    assert not tokenizer.chat.available
    with pytest.raises(InvalidArgument) as info:
        router_ids(model_dir, [USER])
    assert info.value.field == "messages" and "does not compile" in info.value.description
    assert tokenizer.encode("still works")  # text prompts are unaffected


def test_the_sandbox_refuses_unsafe_templates(tiny_llama, tmp_path):
    escapes = {
        "mro": "{{ messages.__class__.__mro__ }}",
        "namespace": "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "mutate": "{% set _ = messages.append(1) %}{{ messages }}",
    }
    for name, source in escapes.items():
        model_dir = model_with_template(tiny_llama, tmp_path / name, source)
        assert field_of(lambda d=model_dir: router_ids(d, [USER])) == "messages.messages", name


def test_the_router_renders_without_torch_or_transformers(model_dirs):
    code = (
        "import sys\n"
        "from pagedserve.router.tokenizer import RouterTokenizer\n"
        "from pagedserve.router.chat import ChatMessage\n"
        f"t = RouterTokenizer.from_model_dir({str(model_dirs['strict'])!r})\n"
        "t.encode(t.chat.render([ChatMessage('user', 'hi')], add_generation_prompt=True))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
