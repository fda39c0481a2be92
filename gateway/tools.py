"""Tool calling on `/v1/chat/completions` (docs/tools.md): the request's `tools` and
`tool_choice` become the router's `GenerateRequest.tools` (for the chat template) and, where the
choice forces a call, a grammar; the answer's text becomes `tool_calls`.

- `tool_choice: "none"`: the tools are not shown to the model; the answer is text.
- `"auto"` (the default with tools): the template shows them; the answer is parsed in the
  format the model was taught (`ModelInfo.tool_call_parser`: Hermes `<tool_call>{...}</tool_call>`,
  Llama 3 JSON `{"name", "parameters"}`, Mistral `[TOOL_CALLS][...]`). Text that does not parse
  as calls stays content, never an error.
- `"required"`: the answer is constrained (xgrammar, in the workers) to a JSON array of at least
  one call `{"name": <one of the tools>, "parameters": <its schema>}` (one call when
  `parallel_tool_calls` is false), parsed as such whatever the model's own format.
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is
  constrained to that function's parameters schema and is its arguments.

Arguments always parse against the function's schema where a grammar forced them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.gateway.errors import invalid
from pagedserve.v1 import common_pb2, generation_pb2


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: FunctionSpec


@dataclass(frozen=True, slots=True)
class Call:
    """One parsed call: `arguments` is JSON text."""

    name: str
    arguments: str
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with its tools: `mode` none, auto, required or named."""

    mode: str
    tools: tuple[ToolSpec, ...]
    named: str = ""
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[ToolSpec] | None, choice: Any, parallel: bool | None) -> ToolPlan:
        """400 naming `tools` / `tool_choice` for what does not fit together."""
        tools_ = tuple(tools or ())
        for i, tool in enumerate(tools_):
            if tool.type != "function":
                raise invalid(f"tools[{i}].type", f"only function tools, got {tool.type!r}")
        names = [t.function.name for t in tools_]
        if len(set(names)) != len(names):
            raise invalid("tools", "function names must be unique")
        parallel_ = True if parallel is None else parallel
        if choice is None:
            return cls("auto" if tools_ else "none", tools_, parallel=parallel_)
        if choice in ("none", "auto", "required"):
            if choice == "required" and not tools_:
                raise invalid("tool_choice", "required needs tools")
            return cls(choice if tools_ else "none", tools_, parallel=parallel_)
        name = _named(choice)
        if name not in names:
            raise invalid("tool_choice", f"function {name!r} is not among the tools")
        return cls("named", tools_, named=name, parallel=parallel_)

    @property
    def active(self) -> bool:
        """Whether the answer may hold calls (the tools reach the model)."""
        return self.mode != "none"

    def request_tools(self) -> list[generation_pb2.Tool]:
        if not self.active:
            return []
        return [
            generation_pb2.Tool(
                name=t.function.name,
                description=t.function.description or "",
                parameters=json.dumps(t.function.parameters or {}),
            )  # fmt: skip
            for t in self.tools
        ]

    def grammar(self) -> common_pb2.StructuredOutput | None:
        """The grammar that forces a call (required, named), else None."""
        if self.mode == "named":
            schema = self._parameters(self.named)
        elif self.mode == "required":
            one = {
                "anyOf": [
                    {"type": "object", "properties": {
                        "name": {"const": t.function.name},
                        "parameters": t.function.parameters or {"type": "object"}},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for t in self.tools
                ]
            }  # fmt: skip
            schema = {"type": "array", "items": one, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema))

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return tool.function.parameters or {"type": "object"}

    def parse(self, text: str, parser: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a whole answer; content None when it is all calls."""
        if self.mode == "named":
            return None, [Call(self.named, text, _call_id())]
        if self.mode == "required":
            calls = _json_calls(text, "parameters")
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            return parse_calls(text, parser)
        return text, []

    def holds_back(self, text: str, parser: str) -> int:
        """How much of an answer's beginning `text` can be streamed as content now: forced
        calls stream nothing; in auto mode, the text up to where a call might begin."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode == "none":
            return len(text)
        marker = _MARKERS.get(parser)
        if parser == "llama3_json":
            return 0 if text.lstrip() == "" or text.lstrip().startswith(("{", "<")) else len(text)
        if marker is None:
            return len(text)
        at = text.find(marker)
        if at >= 0:
            return at
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's start at the end
            if marker.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _named(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise invalid("tool_choice", "none, auto, required or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}")  # fmt: skip


_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(text: str, parser: str) -> tuple[str | None, list[Call]]:
    """An answer in `parser`'s format as (content before the calls, calls). Anything that does
    not parse (malformed JSON, an unknown format) is returned as content, with no calls."""
    if parser == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES.findall(text[start:]):
            call = _call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return (text[:start].strip() or None), calls
    if parser == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        calls = _json_calls(text[start + len("[TOOL_CALLS]") :], "arguments")
        return ((text[:start].strip() or None), calls) if calls else (text, [])
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call(body, "parameters") if body.startswith("{") else None
        return (None, [call]) if call else (text, [])
    return text, []


def _call(body: str, arguments_key: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call_of(value, arguments_key)


def _call_of(value: Any, arguments_key: str) -> Call | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return Call(value["name"], text, _call_id())


def _json_calls(text: str, arguments_key: str) -> list[Call]:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item, arguments_key) for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """One streamed choice of a request with tools: how much of its text goes out as content
    now, and its calls at the end."""

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan, self.parser = plan, parser
        self.text = ""
        self.sent = 0

    @classmethod
    def per_choice(cls, plan: ToolPlan | None, parser: str, n: int) -> list[ToolStream] | None:
        """One per choice of a request whose answers may hold calls, else None."""
        return [cls(plan, parser) for _ in range(n)] if plan is not None and plan.active else None

    def content(self, delta: str) -> str:
        """The content to send for `delta` (text that cannot start a call)."""
        self.text += delta
        safe = max(self.plan.holds_back(self.text, self.parser), self.sent)
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(content still to send, calls) once the choice has ended."""
        _, calls = self.plan.parse(self.text, self.parser)
        return ("", calls) if calls else (self.text[self.sent :], [])


def take_calls(streams: list[ToolStream] | None, choice: Any, part: Any) -> list[Call]:
    """For a streamed chat choice (`responses.Choice`) that got `part`: keep back what may be a
    call (`choice.text` becomes what may go out as content now); at the choice's end, its calls
    (empty: none, or a request without tools)."""
    if streams is None:
        return []
    stream = streams[choice.index]
    choice.text = stream.content(choice.text)
    if not part.finish_reason:
        return []
    rest, calls = stream.finish()
    choice.text += rest
    return calls
