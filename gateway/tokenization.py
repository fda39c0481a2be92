"""vLLM's `POST /tokenize` and `POST /detokenize` bodies, and their translation to the router's
`Tokenize` / `Detokenize` RPCs (the gateway has no tokenizer of its own: docs/gateway.md).

    {"model"?, "prompt", "add_special_tokens"? (true), "return_token_strs"? (false)}
    {"model"?, "messages", "add_generation_prompt"? (true), "continue_final_message"? (false),
     "add_special_tokens"? (false), "return_token_strs"? (false)}
        -> {"count", "max_model_len", "tokens": [...], "token_strs": [...] | null}
    {"model"?, "tokens": [...]} -> {"prompt": "..."}

A body with `messages` is the chat form (rendered by the router with the chat template, as
`/v1/chat/completions` renders it); one with `prompt` the text form; neither is a 400 naming
`prompt`. What pagedserve cannot honour is a 400 naming it (`chat_template`,
`chat_template_kwargs`, `tools`); unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.gateway.errors import invalid
from pagedserve.gateway.protocol import Message, _content, _role
from pagedserve.v1 import generation_pb2

UINT32_END = 1 << 32  # token ids travel as uint32: anything above is out of every vocabulary


class TokenizeCompletionRequest(BaseModel):
    """`POST /tokenize` with a text `prompt`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    def to_proto(self) -> generation_pb2.TokenizeRequest:
        return generation_pb2.TokenizeRequest(
            text=self.prompt,
            add_special_tokens=self.add_special_tokens,
            return_token_strs=bool(self.return_token_strs),
        )


class TokenizeChatRequest(BaseModel):
    """`POST /tokenize` with chat `messages`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        if self.chat_template is not None:
            raise invalid(
                "chat_template", "a per-request chat template is not supported (the router's "
                "--chat-template sets the server's)",
            )  # fmt: skip
        if self.chat_template_kwargs:
            raise invalid("chat_template_kwargs", "chat_template_kwargs are not supported")
        if self.tools:
            raise invalid("tools", "tools are not supported by /tokenize")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid(
                "continue_final_message", "needs add_generation_prompt: false (vLLM's rule)"
            )

    def to_proto(self) -> generation_pb2.TokenizeRequest:
        self.check_supported()
        request = generation_pb2.TokenizeRequest(
            add_special_tokens=self.add_special_tokens,
            add_generation_prompt=self.add_generation_prompt,
            return_token_strs=bool(self.return_token_strs),
        )
        request.messages.SetInParent()
        for index, message in enumerate(self.messages):
            request.messages.messages.add(
                role=_role(message.role), content=_content(message, index)
            )
        return request


TokenizeBody = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=(1 << 63) - 1)]]

    def to_proto(self) -> generation_pb2.DetokenizeRequest:
        for index, token in enumerate(self.tokens):
            if token >= UINT32_END:
                raise invalid("tokens", f"id {token} (at index {index}) is out of vocabulary")
        return generation_pb2.DetokenizeRequest(token_ids=self.tokens)


def parse_tokenize(body: Any) -> TokenizeBody:
    """The body's form: `messages` (chat) or `prompt` (text). 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise invalid(None, "the body must be a JSON object")
    if "messages" in body:
        return _validate(TokenizeChatRequest, body)
    if "prompt" in body:
        return _validate(TokenizeCompletionRequest, body)
    raise invalid("prompt", "one of prompt (a text) or messages (a chat) is required")


def parse_detokenize(body: Any) -> DetokenizeRequest:
    if not isinstance(body, dict):
        raise invalid(None, "the body must be a JSON object")
    return _validate(DetokenizeRequest, body)


def _validate(model: type[Any], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # NOTE: the app's handler names the field, as for the others
        raise RequestValidationError(exc.errors()) from None


def tokenize_answer(
    answer: generation_pb2.TokenizeResponse, max_model_len: int, with_strs: bool
) -> dict[str, Any]:
    """vLLM's TokenizeResponse (`token_strs` null unless asked for)."""
    tokens = list(answer.token_ids)
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": tokens,
        "token_strs": list(answer.token_strs) if with_strs else None,
    }


def tokenize_param(field: str) -> str | None:
    """The body's parameter behind the router's field path (`messages.messages[0].role`)."""
    if field.startswith("messages"):
        return "messages"
    return "prompt" if field == "text" else field


def detokenize_param(field: str) -> str | None:
    return "tokens" if field == "token_ids" else field
