"""Chat prompts: the router's rendering equals transformers' apply_chat_template token for token,
and bad conversations are INVALID_ARGUMENT naming the field (router/chat.py, router/convert.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.chat_templates import CHATML, HERMES, STRICT, TOOLKIT, model_with_template
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


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL_LOOP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "12 C, rain"},
]  # fmt: skip


def test_tools_and_tool_calls_reach_the_template_as_transformers_do(tiny_llama, tmp_path):
    model_dir = model_with_template(tiny_llama, tmp_path / "hermes", HERMES)
    tools = [{"type": "function", "function": {"name": "weather", "description": "Now.",
                                               "parameters": WEATHER}}]  # fmt: skip
    msg = generation_pb2.GenerateRequest()
    msg.messages.SetInParent()
    for m in TOOL_LOOP:
        turn = msg.messages.messages.add(role=m["role"], content=m["content"],
                                         name=m.get("name", ""),
                                         tool_call_id=m.get("tool_call_id", ""))  # fmt: skip
        for call in m.get("tool_calls", ()):
            turn.tool_calls.add(id=call["id"], name=call["function"]["name"],
                                arguments=json.dumps(call["function"]["arguments"]))  # fmt: skip
    msg.tools.add(name="weather", description="Now.", parameters=json.dumps(WEATHER))
    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    assert tokenizer.chat.tool_call_parser == "hermes"
    ours = convert.router_request(msg, tokenizer, read_model_card(model_dir)).prompt_token_ids
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    want = hf.apply_chat_template(TOOL_LOOP, tools=tools, add_generation_prompt=True,
                                  tokenize=False)  # fmt: skip
    assert "<tools>" in want and "<tool_call>" in want and "<tool_response>" in want
    assert ours == hf(want, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("source", "parser"),
    [(HERMES, "hermes"), ("{{ '[TOOL_CALLS]' }}", "mistral"),
     ("{{ '<|python_tag|>' }}", "llama3_json"), (CHATML, ""), (None, "")],
)  # fmt: skip
def test_the_tool_call_format_is_detected_from_the_template(source, parser):
    assert ChatTemplate(source).tool_call_parser == parser


def test_bad_tools_are_invalid_argument_naming_them(model_dirs):
    tokenizer = RouterTokenizer.from_model_dir(model_dirs["chatml"])
    card = read_model_card(model_dirs["chatml"])
    for tool, field in (
        (generation_pb2.Tool(name="bad name"), "tools[0].name"),
        (generation_pb2.Tool(name="f", parameters="{nope"), "tools[0].parameters"),
        (generation_pb2.Tool(name="f", parameters="[]"), "tools[0].parameters"),
    ):
        msg = request([USER])
        msg.tools.append(tool)
        with pytest.raises(InvalidArgument) as info:
            convert.router_request(msg, tokenizer, card)
        assert info.value.field == field
