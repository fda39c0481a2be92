"""OpenAI request bodies (pydantic) and their translation into `GenerateRequest`s.

Parameters follow the OpenAI API reference; vLLM's extra sampling parameters are accepted where
pagedserve has them (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `skip_special_tokens`, `priority`, `cache_salt`, `add_special_tokens`,
`add_generation_prompt`, `continue_final_message`). Unknown fields are ignored, as OpenAI's and
vLLM's servers do; a parameter pagedserve cannot honour (`logit_bias`, tools, JSON mode, `echo`,
`suffix`, image content) is a 400 naming it, never silently dropped. Range checks are the
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

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.gateway.errors import invalid
from pagedserve.v1 import common_pb2, generation_pb2

UInt32 = Annotated[int, Field(ge=0, lt=1 << 32)]
MAX_PROMPTS = 64  # completions with a list of prompts: at most this many in one request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

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

    def check_supported(self) -> None:
        """400 for what pagedserve cannot do yet (rather than answering something else)."""
        if self.logit_bias:
            raise invalid("logit_bias", "logit_bias is not supported")

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
        return out

    def base_request(self, request_id: str) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=request_id,
            sampling=self.sampling(),
            priority=self.priority,
            cache_salt=self.cache_salt or "",
            stream=self.stream,
        )

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
    logprobs: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    echo: bool = False
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
        if self.echo:
            raise invalid("echo", "echo is not supported")
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
        return _sampling_param(field, "logprobs", max_tokens="max_tokens")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[Message]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=1 << 32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise invalid("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "tool calling is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid("response_format", "only the text response format is supported")
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
            request.messages.messages.add(
                role=_role(message.role), content=_content(message, index)
            )
        request.add_generation_prompt = self.add_generation_prompt
        return [request]

    def param_of(self, field: str) -> str | None:
        if field.startswith("messages"):
            return "messages"
        limit = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return _sampling_param(field, "top_logprobs", max_tokens=limit)


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # NOTE: OpenAI's newer name for system


def _content(message: Message, index: int) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM does)."""
    if message.tool_calls:
        raise invalid(f"messages[{index}].tool_calls", "tool calls are not supported")
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


def _sampling_param(field: str, logprobs: str, *, max_tokens: str) -> str | None:
    """The OpenAI parameter behind the router's field path."""
    name = field.removeprefix("sampling.")
    renamed: dict[str, str] = {"logprobs": logprobs, "max_tokens": max_tokens}
    if name in ("request_id",):
        return None
    return renamed.get(name, name)


Endpoint = Literal["completions", "chat"]
