"""Chat templates: a conversation -> the prompt text the model was trained on.

Renders the model's own Jinja chat template the way transformers' `apply_chat_template` does,
without transformers or torch (docs/chat.md): the same sandboxed environment (immutable sandbox,
`trim_blocks`, `lstrip_blocks`, the loop-controls extension, a pass-through `{% generation %}`
tag, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and does not escape
HTML, and a `namespace`/`dict` that refuse underscore names) and the same template variables
(`messages`, `tools=None`, `documents=None`, `add_generation_prompt`, and the tokenizer's named
special tokens such as `bos_token`). The rendered text already holds the template's special
tokens, so it is tokenized WITHOUT adding special tokens (as `apply_chat_template(tokenize=True)`).

Where the template comes from: the router's `--chat-template FILE` when given (it overrides the
model's, or supplies one for a base model without any; a file that cannot be read or does not
compile stops the router at start-up), else as transformers reads a model directory:
`chat_template.jinja` if present, else `chat_template` in `tokenizer_config.json` (a string, or a
list of named templates of which `default` is used).

Templates are untrusted code from the model's authors: only the sandbox runs them, and every
error they raise is the request's problem (INVALID_ARGUMENT), never the router's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedserve.errors import InvalidArgument

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have; anything else is rejected before the template runs."""

SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
"""The tokenizer's named special tokens, passed to the template as variables (transformers'
`special_tokens_map`)."""

MAX_CHAT_CHARS = 1 << 20
"""Most characters of message content in one conversation (the text prompt's limit)."""


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
"""The formats of a tool call in a model's answer that the gateway parses (docs/tools.md)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call an assistant turn made: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn: `role` is one of ROLES, `content` plain text (checked by `render`); `name`,
    `tool_call_id` and `tool_calls` reach the template only when set (OpenAI's fields)."""

    role: str
    content: str
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def for_template(self) -> dict[str, Any]:
        """The message as transformers passes it to a template: a tool call's arguments as an
        object where they parse (templates `tojson` them), else the text as given."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def detect_tool_call_parser(source: str | None) -> str:
    """The tool-call format a chat template teaches its model, from the markers it writes:
    Hermes' `<tool_call>` (Qwen2.5, Hermes, SmolLM3), Mistral's `[TOOL_CALLS]`, Llama 3's
    `<|python_tag|>` / `ipython` role; "" when it shows none."""
    if not source:
        return ""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return ""


class ChatTemplate:
    """The model's chat template, compiled once; `render` is thread-safe (it only reads).

    A model without a usable template still gets a ChatTemplate: `available` is False and
    `unavailable_reason` says why (no template, or one that does not compile).
    """

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None) -> None:
        """Raises ValueError when `source` does not compile."""
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.tool_call_parser = detect_tool_call_parser(source)  # the router's flag may override
        self.unavailable_reason = (
            "the model directory has no chat template (the router's --chat-template FILE gives one)"
        )
        self._template: jinja2.Template | None = None
        if source is not None:
            try:
                self._template = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(
                    f"chat template does not compile: line {exc.lineno}: {exc}"
                ) from None

    @property
    def available(self) -> bool:
        return self._template is not None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate:
        """Read the template and special tokens of a model directory. Never raises for a bad
        template of the model's: it is logged and the result is unavailable (text prompts still
        work). `override` (the source of `--chat-template`, see `read_template_file`) replaces
        the model's template; it must compile (ValueError otherwise)."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        special = _special_tokens(config, _read_json(model_dir / "special_tokens_map.json"))
        if override is not None:
            return cls(override, special)
        source = _template_source(model_dir, config)
        try:
            return cls(source, special)
        except ValueError as exc:
            log.error("%s: %s; chat requests will be refused", model_dir, exc)
            broken = cls(None, special)
            broken.unavailable_reason = f"the model's {exc}"
            return broken

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of `messages`, with `tools` (OpenAI's function entries) where the
        request has them. Raises InvalidArgument naming `messages` (empty, too long, the
        template unavailable or failing) or `messages[i].role` / `.content`."""
        if self._template is None:
            raise InvalidArgument("messages", self.unavailable_reason)
        _check(messages)
        variables: dict[str, Any] = {
            "messages": [m.for_template() for m in messages],
            "tools": list(tools) if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.special_tokens,
        }
        try:
            return self._template.render(**variables)
        # NOTE: the template is the model's code running on the caller's conversation: whatever
        # it raises (raise_exception, an undefined name, a type error, a sandbox refusal) means
        # "this conversation cannot be rendered", which is the request's INVALID_ARGUMENT
        except Exception as exc:  # noqa: BLE001
            raise InvalidArgument(
                "messages", f"the model's chat template rejected the conversation: {exc}"
            ) from None


def read_template_file(path: str | Path) -> str:
    """The source of a `--chat-template FILE`, checked to compile. ValueError naming the flag
    and the file when it cannot be read, is not UTF-8 text, is empty or does not compile."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--chat-template {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--chat-template {path}: not UTF-8 text ({exc.reason})") from None
    if not source.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    try:
        ChatTemplate(source)
    except ValueError as exc:
        raise ValueError(f"--chat-template {path}: {exc}") from None
    return source


def _check(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise InvalidArgument("messages", "must hold at least one message")
    total = 0
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}"
            )
        if not isinstance(message.content, str):
            raise InvalidArgument(
                f"messages[{i}].content", f"must be a string, got {type(message.content).__name__}"
            )
        total += len(message.content)
    if total > MAX_CHAT_CHARS:
        raise InvalidArgument("messages", f"content must be <= {MAX_CHAT_CHARS} characters in all")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


def _special_tokens(config: dict[str, Any], fallback: dict[str, Any]) -> dict[str, str]:
    """Named special tokens as strings; an AddedToken is written as {"content": ...}."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, fallback.get(name))
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


# ---- the rendering environment ---------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing attributes that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _SafeDict:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env
