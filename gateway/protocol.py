"""OpenAI request bodies (pydantic) and their translation into `GenerateRequest`s.

Parameters follow the OpenAI API reference; vLLM's extra sampling parameters are accepted where
pagedserve has them (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `skip_special_tokens`, `priority`, `cache_salt`, `add_special_tokens`,
`add_generation_prompt`, `continue_final_message`, `allowed_token_ids`, `bad_words`,
`use_beam_search`, `length_penalty`, `structured_outputs` and the `guided_*` grammars).
`response_format` and the grammars become one `StructuredOutput` (docs/structured_output.md);
tools go through gateway/tools.py (docs/tools.md). Unknown fields are ignored, as OpenAI's and
vLLM's servers do; a parameter pagedserve cannot honour (`suffix`, image content,
REFUSED_FIELDS) is a 400 naming it, never silently dropped. Range checks are the
router's (one place, the same for gRPC clients); the gateway checks only what the protos cannot
carry (negative integers) and what is OpenAI's own (model, content parts, `best_of` > n with
`stream`).

Samples: `n` (both endpoints) and `best_of` (completions) travel as `sampling.n` /
`sampling.best_of` of one `GenerateRequest` per prompt; the router generates them (`--max-n`
bounds them: 400 naming `n` or `best_of`). Prompt p's sample i is choice `p * n + i`, as in
vLLM. `best_of` > n answers only once every sample has ended, so it cannot be streamed: with
`stream: true` it is a 400 naming `best_of` (OpenAI: "results cannot be streamed"; vLLM 0.x
silently answered without streaming instead, and vLLM V1 rejects `best_of` altogether).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.gateway.errors import invalid
from pagedserve.gateway.tools import ToolPlan, ToolSpec
from pagedserve.v1 import common_pb2, generation_pb2

UInt32 = Annotated[int, Field(ge=0, lt=1 << 32)]
MAX_PROMPTS = 64  # completions with a list of prompts: at most this many in one request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(BaseModel):
    """What both endpoints share. Unknown fields are kept aside (`model_extra`) only to refuse
    the ones in REFUSED_FIELDS."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1, lt=1 << 32)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: UInt32 | None = None  # NOTE: None is 1; 0 reaches the router, which names `n`
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra parameters
    top_k: Annotated[int, Field(ge=-1, lt=1 << 32)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: UInt32 | None = None
    stop_token_ids: list[UInt32] | None = None
    skip_special_tokens: bool | None = None
    priority: Annotated[int, Field(ge=-(1 << 31), lt=1 << 31)] = 0
    cache_salt: str | None = None
    allowed_token_ids: list[UInt32] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # vLLM's structured outputs: `structured_outputs` (newer) and the `guided_*` extras
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def check_supported(self) -> None:
        """400 for what pagedserve cannot do (rather than answering something else)."""
        extra = self.model_extra or {}
        for name in REFUSED_FIELDS:
            if extra.get(name) not in (None, False, [], {}):
                raise invalid(name, f"{name} is not supported by this server")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise invalid("guided_decoding_backend", "this server constrains with xgrammar only")
        self.structured_output()  # NOTE: its 400s before anything else happens

    def structured_output(self) -> tuple[str, common_pb2.StructuredOutput] | None:
        """The request's grammar and the parameter it came from (the one its errors name); a
        400 when more than one parameter asks for one."""
        found = [g for g in (_response_format(self.response_format), *self._vllm_grammars()) if g]
        if len(found) > 1:
            raise invalid(found[1][0], f"only one structured output per request ({found[0][0]} "
                          "is already one)")  # fmt: skip
        return found[0] if found else None

    def _vllm_grammars(self) -> list[tuple[str, common_pb2.StructuredOutput] | None]:
        out: list[tuple[str, common_pb2.StructuredOutput] | None] = []
        if self.guided_json is not None:
            out.append(("guided_json", _grammar("json_schema", _schema_text(self.guided_json))))
        if self.guided_regex is not None:
            out.append(("guided_regex", _grammar("regex", self.guided_regex)))
        if self.guided_choice is not None:
            out.append(("guided_choice", _grammar("choice", self.guided_choice)))
        if self.guided_grammar is not None:
            out.append(("guided_grammar", _grammar("grammar", self.guided_grammar)))
        if self.structured_outputs:
            out.append(_structured_outputs(self.structured_outputs))
        return out

    def sampling(self) -> common_pb2.SamplingParams:
        out = common_pb2.SamplingParams()
        for name in (
            "temperature", "top_p", "min_p", "seed", "min_tokens", "ignore_eos",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, value)
        if self.top_k is not None:
            out.top_k = max(self.top_k, 0)  # NOTE: vLLM's -1 is our 0: no top-k
        if self.max_tokens is not None:
            out.max_tokens = self.max_tokens
        if self.n is not None:
            out.n = self.n
        out.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        out.stop_token_ids.extend(self.stop_token_ids or [])
        out.allowed_token_ids.extend(self.allowed_token_ids or [])
        out.bad_words.extend(self.bad_words or [])
        for key, bias in (self.logit_bias or {}).items():
            out.logit_bias[_token_id(key)] = bias
        if self.use_beam_search:
            out.use_beam_search = True
        if self.length_penalty is not None:
            out.length_penalty = self.length_penalty
        grammar = self.structured_output()
        if grammar is not None:
            out.structured_output.CopyFrom(grammar[1])
        return out

    def base_request(self, request_id: str) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=request_id,
            sampling=self.sampling(),
            priority=self.priority,
            cache_salt=self.cache_salt or "",
            stream=self.stream,
        )

    def _source(self) -> str:
        found = self.structured_output()
        return found[0] if found else "response_format"

    @property
    def samples(self) -> int:
        """Choices per prompt (`n`): the router's messages of prompt p, sample i are choice
        `p * samples + i`."""
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[UInt32] | list[list[UInt32]]
    max_tokens: UInt32 | None = None  # NOTE: 0 only with echo (the prompt alone)
    logprobs: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    echo: bool = False  # the prompt before the choice's text and logprobs (gateway/echo.py)
    suffix: str | None = None
    best_of: UInt32 | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise invalid("prompt", "must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if len(prompt) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request")
        return list(prompt)  # type: ignore[arg-type]

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens", "must be >= 1 (0 only with echo: the prompt alone)")
        if self.suffix:
            raise invalid("suffix", "suffix is not supported")
        if self.stream and self.best_of is not None and self.best_of > self.samples >= 1:
            raise invalid(
                "best_of", f"best_of ({self.best_of}) > n ({self.samples}) cannot be streamed: "
                "the best samples are known only when every sample has ended",
            )  # fmt: skip

    def generate_requests(self, request_id: str) -> list[generation_pb2.GenerateRequest]:
        self.check_supported()
        out = []
        for index, prompt in enumerate(self.prompts()):
            request = self.base_request(request_id if index == 0 else f"{request_id}-{index}")
            if self.logprobs is not None:
                request.sampling.logprobs = self.logprobs
                if self.echo:
                    request.sampling.prompt_logprobs = self.logprobs
            if self.max_tokens == 0:
                request.sampling.max_tokens = 1  # NOTE: generated, then dropped (echo.py)
            if self.best_of is not None:
                request.sampling.best_of = self.best_of
            if isinstance(prompt, str):
                request.text = prompt
                request.add_special_tokens = self.add_special_tokens
            else:
                request.token_ids.ids.extend(prompt)
            out.append(request)
        return out

    def param_of(self, field: str) -> str | None:
        if field in ("text", "token_ids", "prompt"):
            return "prompt"
        return _sampling_param(field, "logprobs", max_tokens="max_tokens", grammar=self._source())


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: str = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[Message]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=1 << 32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def tool_plan(self) -> ToolPlan:
        """What the request does with its tools (gateway/tools.py); 400s naming the field."""
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def check_supported(self) -> None:
        super().check_supported()
        plan = self.tool_plan()
        if plan.grammar() is not None and self.structured_output() is not None:
            raise invalid("tool_choice", f"{plan.mode} tool choice forces a grammar: no "
                          f"{self._source()} with it")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid(
                "continue_final_message", "needs add_generation_prompt: false (vLLM's rule)"
            )

    def generate_requests(self, request_id: str) -> list[generation_pb2.GenerateRequest]:
        self.check_supported()
        request = self.base_request(request_id)
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None:
            request.sampling.max_tokens = limit
        request.max_tokens_to_fit = True  # NOTE: OpenAI's chat default: the rest of the context
        if self.logprobs:
            request.sampling.logprobs = self.top_logprobs or 0
        request.messages.SetInParent()
        for index, message in enumerate(self.messages):
            turn = request.messages.messages.add(
                role=_role(message.role), content=_content(message, index),
                name=message.name or "", tool_call_id=message.tool_call_id or "",
            )  # fmt: skip
            for call in message.tool_calls or ():
                turn.tool_calls.add(id=call.id, name=call.function.name,
                                    arguments=call.function.arguments)  # fmt: skip
        request.add_generation_prompt = self.add_generation_prompt
        plan = self.tool_plan()
        request.tools.extend(plan.request_tools())
        grammar = plan.grammar()
        if grammar is not None:
            request.sampling.structured_output.CopyFrom(grammar)
        return [request]

    def _source(self) -> str:
        if self.tool_plan().grammar() is not None:
            return "tool_choice"
        return super()._source()

    def param_of(self, field: str) -> str | None:
        if field.startswith(("messages", "tools")):
            return field.split(".", 1)[0].split("[", 1)[0]
        limit = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return _sampling_param(field, "top_logprobs", max_tokens=limit, grammar=self._source())


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # NOTE: OpenAI's newer name for system


def _content(message: Message, index: int) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM does)."""
    if message.tool_calls and message.role != "assistant":
        raise invalid(f"messages[{index}].tool_calls", "only assistant messages make tool calls")
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid(
                f"messages[{index}].content", f"content parts of type {part.type!r} are not "
                "supported (text only)",
            )  # fmt: skip
        texts.append(part.text)
    return "\n".join(texts)


def _sampling_param(field: str, logprobs: str, *, max_tokens: str, grammar: str) -> str | None:
    """The OpenAI parameter behind the router's field path (`grammar`: the parameter the
    request's structured output came from)."""
    name = field.removeprefix("sampling.")
    renamed: dict[str, str] = {"logprobs": logprobs, "max_tokens": max_tokens}
    if name in ("request_id",):
        return None
    if name.startswith("structured_output"):
        return grammar
    return renamed.get(name, name)


REFUSED_FIELDS = (
    "functions", "function_call", "audio", "prediction", "web_search_options",
    "prompt_logprobs", "guided_whitespace_pattern", "include_stop_str_in_output",
    "truncate_prompt_tokens", "logits_processors", "vllm_xargs", "return_tokens_as_token_ids",
)  # fmt: skip
"""OpenAI's and vLLM's request fields this server does not honour: a 400 naming the field
(docs/gateway.md), never a 200 that quietly answered something else."""


def _grammar(kind: str, value: Any) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput()
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise invalid("guided_choice", "must be a list of strings")
        msg.choice.choices.extend(value)
    elif kind == "json":
        msg.json = True
    else:
        if not isinstance(value, str):
            raise invalid(kind, "must be a string")
        setattr(msg, kind, value)
    return msg


def _schema_text(schema: Any) -> str:
    """A JSON schema as JSON text (it may come as an object or as a string of JSON)."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def _response_format(
    value: dict[str, Any] | None,
) -> tuple[str, common_pb2.StructuredOutput] | None:
    """OpenAI's `response_format`: text (none), json_object, json_schema {name, schema, strict}."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", _grammar("json", True)
    if kind != "json_schema":
        raise invalid("response_format", f"type must be text, json_object or json_schema, "
                      f"got {kind!r}")  # fmt: skip
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | str):
        raise invalid("response_format", "json_schema must be an object with a `schema`")
    # NOTE: `strict` false or absent is served strictly too: the output always follows the schema
    return "response_format", _grammar("json_schema", _schema_text(spec.get("schema", {})))


_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json"}  # fmt: skip


def _structured_outputs(value: dict[str, Any]) -> tuple[str, common_pb2.StructuredOutput]:
    """vLLM's `structured_outputs` {json | regex | choice | grammar | json_object}."""
    given = [k for k, v in value.items() if v not in (None, False)]
    unknown = [k for k in given if k not in _STRUCTURED_KEYS]
    if unknown:
        raise invalid("structured_outputs", f"{unknown[0]!r} is not supported")
    if len(given) != 1:
        raise invalid("structured_outputs", "set exactly one of json, regex, choice, grammar, "
                      "json_object")  # fmt: skip
    key = given[0]
    kind = _STRUCTURED_KEYS[key]
    spec = _schema_text(value[key]) if key == "json" else value[key]
    return "structured_outputs", _grammar(kind, spec)


def _token_id(key: str) -> int:
    """A `logit_bias` key: a token id as a string."""
    try:
        token_id = int(key)
    except ValueError:
        raise invalid("logit_bias", f"keys are token ids, got {key!r}") from None
    if not 0 <= token_id < 1 << 32:
        raise invalid("logit_bias", f"token id {token_id} is out of range")
    return token_id


Endpoint = Literal["completions", "chat"]
