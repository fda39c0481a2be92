"""Tool calling in the gateway without processes (gateway/tools.py): each parser on fixed
strings, malformed output returned as content, the grammars that force a call, and streaming
that holds back only what may be a call."""

from __future__ import annotations

import json

import pytest

from pagedserve.gateway.errors import GatewayError
from pagedserve.gateway.tools import ToolPlan, ToolSpec, ToolStream, parse_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    ToolSpec.model_validate({"type": "function", "function": {"name": "weather",
                                                              "parameters": WEATHER}}),
    ToolSpec.model_validate({"type": "function", "function": {"name": "time"}}),
]  # fmt: skip


def calls_of(text: str, parser: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_calls(text, parser)
    assert all(c.id.startswith("call_") for c in calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}'
         '\n</tool_call>', "Let me check.", [("weather", {"city": "Oslo"})]),
        ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call>\n'
         '<tool_call>{"name": "time", "arguments": {}}</tool_call>', None,
         [("weather", {"city": "A"}), ("time", {})]),
        ("hermes", '<tool_call>{"name": "time", "arguments": {}}', None, [("time", {})]),
        ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}]', None,
         [("weather", {"city": "Rome"})]),
        ("llama3_json", '{"name": "weather", "parameters": {"city": "Lima"}}', None,
         [("weather", {"city": "Lima"})]),
        ("llama3_json", '<|python_tag|>{"name": "time", "parameters": {}}', None, [("time", {})]),
    ],
)  # fmt: skip
def test_each_format_parses_into_calls(parser, text, content, calls):
    assert calls_of(text, parser) == (content, calls)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "No tools needed: it is sunny."),
        ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'),
        ("hermes", '<tool_call>["not", "a", "call"]</tool_call>'),
        ("mistral", "[TOOL_CALLS] not json"),
        ("llama3_json", '{"city": "no name"}'),
        ("llama3_json", "{ broken"),
        ("", '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'),
    ],
)  # fmt: skip
def test_malformed_or_plain_output_stays_content(parser, text):
    assert parse_calls(text, parser) == (text, [])


def test_required_forces_an_array_of_known_calls_and_named_the_arguments():
    required = ToolPlan.of(TOOLS, "required", parallel=False)
    schema = json.loads(required.grammar().json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [v["properties"]["name"]["const"] for v in schema["items"]["anyOf"]]
    assert names == ["weather", "time"]
    content, calls = required.parse('[{"name": "weather", "parameters": {"city": "X"}}]', "")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "X"})
    ]
    named = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    assert json.loads(named.grammar().json_schema) == WEATHER
    assert named.parse('{"city": "Y"}', "hermes")[1][0].arguments == '{"city": "Y"}'
    auto = ToolPlan.of(TOOLS, None, None)
    assert auto.mode == "auto" and auto.grammar() is None
    assert [t.name for t in auto.request_tools()] == ["weather", "time"]
    assert ToolPlan.of(TOOLS, "none", None).request_tools() == []


def test_a_bad_tool_choice_is_a_400_naming_it():
    for choice in ("always", {"type": "function"}, {"type": "function", "function": {"name": "x"}}):
        with pytest.raises(GatewayError) as info:
            ToolPlan.of(TOOLS, choice, None)
        assert info.value.param == "tool_choice"


def test_streaming_holds_back_only_what_may_be_a_call():
    stream = ToolStream(ToolPlan.of(TOOLS, "auto", None), "hermes")
    sent = [stream.content(d) for d in ("Checking", " now <to", "ol_call>", '{"name": "time"',
                                        ', "arguments": {}}', "</tool_call>")]  # fmt: skip
    assert sent == ["Checking", " now ", "", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["time"]
    plain = ToolStream(ToolPlan.of(TOOLS, "auto", None), "hermes")
    assert [plain.content(d) for d in ("a <b", "c> d")] == ["a <b", "c> d"]
    assert plain.finish() == ("", [])
    held = ToolStream(ToolPlan.of(TOOLS, "auto", None), "hermes")
    assert held.content("<tool") == ""
    assert held.finish() == ("<tool", [])  # it was no call after all: sent at the end
    forced = ToolStream(ToolPlan.of(TOOLS, "required", None), "")
    assert forced.content('[{"name": "time", "parameters": {}}]') == ""
    assert [c.name for c in forced.finish()[1]] == ["time"]
