"""The router's edge: public `pagedserve.v1.Generation` messages <-> validated requests.

Every check happens here, before any worker sees the request (docs/router.md): a bad field raises
`InvalidArgument` naming it (`sampling.top_p`, `token_ids`, ...), which the interceptor turns
into INVALID_ARGUMENT with a `BadRequest.FieldViolation`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.errors import InvalidArgument
from pagedserve.internal.v1 import worker_pb2
from pagedserve.protoconv import sampling_from_proto, sampling_to_proto
from pagedserve.router.chat import ChatMessage, ToolCall
from pagedserve.router.tokenizer import ModelCard, RouterTokenizer
from pagedserve.sampling_params import (
    DEFAULT_MAX_N,
    MAX_BAD_WORDS,
    MAX_STOP_STRING_LEN,
    SamplingParams,
)
from pagedserve.v1 import generation_pb2

MAX_REQUEST_ID_LEN = 128
MAX_CACHE_SALT_LEN = 256
MAX_PROMPT_CHARS = 1 << 20
MAX_STREAM_INTERVAL = 1 << 16


@dataclass(frozen=True, slots=True)
class RouterRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str
    stream: bool
    stream_interval: int = 1  # the least new tokens per streamed message after the first


def router_request(
    msg: generation_pb2.GenerateRequest,
    tokenizer: RouterTokenizer,
    card: ModelCard,
    default_stream_interval: int = 1,
    max_n: int = DEFAULT_MAX_N,
) -> RouterRequest:
    """Validate and tokenize; raises InvalidArgument naming the first bad field.
    `default_stream_interval` is the router's `--stream-interval`, `max_n` its `--max-n`."""
    request_id = msg.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise InvalidArgument("request_id", f"must be printable and <= {MAX_REQUEST_ID_LEN} chars")
    if len(msg.cache_salt) > MAX_CACHE_SALT_LEN:
        raise InvalidArgument("cache_salt", f"must be <= {MAX_CACHE_SALT_LEN} chars")
    if msg.stream_interval > MAX_STREAM_INTERVAL:
        raise InvalidArgument(
            "stream_interval", f"must be <= {MAX_STREAM_INTERVAL}, got {msg.stream_interval}"
        )
    prompt = _prompt_ids(msg, tokenizer, card)
    if len(prompt) >= card.max_model_len:
        raise InvalidArgument(
            msg.WhichOneof("prompt") or "prompt",
            f"{len(prompt)} prompt tokens leave no room under max_model_len {card.max_model_len}",
        )
    try:
        params = sampling_from_proto(msg.sampling, card.sampling_defaults)
    except InvalidArgument as exc:
        raise exc.with_prefix("sampling") from None
    if params.bad_words:
        params = dataclasses.replace(params, bad_word_ids=bad_word_ids(params, tokenizer))
    if msg.sampling.use_beam_search and not msg.sampling.HasField("temperature"):
        params = dataclasses.replace(params, temperature=0.0)  # NOTE: not the model's default
    if msg.max_tokens_to_fit and not msg.sampling.HasField("max_tokens"):
        params = dataclasses.replace(params, max_tokens=card.max_model_len - len(prompt))
    try:
        params.validate(
            vocab_size=card.vocab_size,
            max_model_len=card.max_model_len,
            prompt_len=len(prompt),
            max_n=max_n,
        )
    except InvalidArgument as exc:
        raise exc.with_prefix("sampling") from None
    return RouterRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        stream=msg.stream,
        stream_interval=msg.stream_interval or default_stream_interval,
    )


def _prompt_ids(
    msg: generation_pb2.GenerateRequest, tokenizer: RouterTokenizer, card: ModelCard
) -> list[int]:
    kind = msg.WhichOneof("prompt")
    add_special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    if kind is None:
        raise InvalidArgument("prompt", "set one of text, token_ids or messages")
    if kind == "messages":
        return _chat_prompt_ids(msg, tokenizer, card)
    if kind == "text":
        if not msg.text:
            raise InvalidArgument("text", "must not be empty")
        if len(msg.text) > MAX_PROMPT_CHARS:
            raise InvalidArgument("text", f"must be <= {MAX_PROMPT_CHARS} characters")
        _check_fits(msg.text, "text", tokenizer, card)
        ids = tokenizer.encode(msg.text, add_special_tokens=add_special)
        if not ids:
            raise InvalidArgument("text", "tokenizes to no tokens")
        return ids
    ids = list(msg.token_ids.ids)
    if not ids:
        raise InvalidArgument("token_ids", "must not be empty")
    bad = next((t for t in ids if t >= card.vocab_size), None)
    if bad is not None:
        raise InvalidArgument("token_ids", f"id {bad} is not below vocab_size {card.vocab_size}")
    return ids


MAX_TOOLS = 128
"""Most functions one request may offer the model (OpenAI's limit)."""

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def chat_messages(msg: generation_pb2.ChatMessages) -> list[ChatMessage]:
    """The conversation, with OpenAI's name / tool_call_id / tool_calls where set."""
    return [
        ChatMessage(
            m.role,
            m.content,
            m.name,
            m.tool_call_id,
            tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
        )  # fmt: skip
        for m in msg.messages
    ]


def template_tools(tools: Sequence[generation_pb2.Tool]) -> list[dict[str, Any]] | None:
    """`GenerateRequest.tools` as transformers gives them to a template (OpenAI's function
    entries, parameters as an object); InvalidArgument naming `tools[i]...`."""
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not _TOOL_NAME.fullmatch(tool.name):
            raise InvalidArgument(f"tools[{i}].name", "1-64 letters, digits, '_' or '-', got "
                                  f"{tool.name!r}")  # fmt: skip
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else {}
        except ValueError as e:
            raise InvalidArgument(f"tools[{i}].parameters", f"not valid JSON: {e}") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].parameters", "must be a JSON schema object")
        function = {"name": tool.name, "description": tool.description, "parameters": parameters}
        out.append({"type": "function", "function": function})
    return out


def _chat_prompt_ids(
    msg: generation_pb2.GenerateRequest, tokenizer: RouterTokenizer, card: ModelCard
) -> list[int]:
    """Render the conversation with the model's template; the text holds its special tokens."""
    if not tokenizer.chat.available:
        raise InvalidArgument("messages", tokenizer.chat.unavailable_reason)
    messages = chat_messages(msg.messages)
    add_prompt = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    tools = template_tools(msg.tools)
    try:
        text = tokenizer.chat.render(messages, add_generation_prompt=add_prompt, tools=tools)
    except InvalidArgument as exc:
        raise exc.with_prefix("messages") from None
    _check_fits(text, "messages", tokenizer, card)
    # NOTE: as transformers' apply_chat_template(tokenize=True): the template wrote BOS etc.
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidArgument("messages", "the chat template rendered no tokens")
    return ids


def _check_fits(text: str, field: str, tokenizer: RouterTokenizer, card: ModelCard) -> None:
    """Refuse, before tokenizing, a text whose token count is provably too large.

    NOTE: tokenizing a ~1 MB prompt costs about a second of router CPU and leaves the process
    hundreds of MB larger; the byte-length bound (`RouterTokenizer.min_tokens`) costs a pass
    over the bytes and refuses only prompts that could never fit.
    """
    at_least = tokenizer.min_tokens(text)
    if at_least >= card.max_model_len:
        raise InvalidArgument(
            field,
            f"at least {at_least} prompt tokens leave no room under max_model_len "
            f"{card.max_model_len}",
        )


def bad_word_ids(params: SamplingParams, tokenizer: RouterTokenizer) -> tuple[tuple[int, ...], ...]:
    """`params.bad_word_ids` and the token sequences of `params.bad_words`: each word as it
    starts a text and after a space (vLLM's two forms), without special tokens. Words past the
    limits are left to `validate` (nothing is tokenized for them)."""
    words = params.bad_words
    if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_STOP_STRING_LEN for w in words):
        return params.bad_word_ids
    out = list(params.bad_word_ids)
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def continuation(request: RouterRequest, generated: list[int]) -> RouterRequest:
    """The request that goes on from `generated` (tokens the client already has) on another
    pair of workers: they become part of the prompt, and the budget shrinks by as many; a
    structured output's grammar replays them (`resumed_tokens`).

    NOTE: greedy output is that of the undisturbed run. A seeded request draws from a generator
    seeded from (seed, tokens generated): deterministic, but not the undisturbed draws; presence
    and frequency penalties (over output tokens) no longer see the moved tokens.
    """
    p, n = request.params, len(generated)
    grammar = p.structured_output
    if grammar is not None:  # NOTE: the new workers replay the moved tokens into the grammar
        grammar = dataclasses.replace(grammar, resumed_tokens=grammar.resumed_tokens + n)
    params = dataclasses.replace(
        p,
        max_tokens=p.max_tokens - n,
        min_tokens=max(0, p.min_tokens - n),
        seed=None if p.seed is None else (p.seed + n) % (1 << 63),
        structured_output=grammar,
        prompt_logprobs=None,  # NOTE: the first pair returned them already
    )
    return dataclasses.replace(
        request, prompt_token_ids=[*request.prompt_token_ids, *generated], params=params
    )


def worker_request(request: RouterRequest, request_id: str) -> worker_pb2.WorkerRequest:
    """What the workers get; `request_id` is the worker-side id (`auth.worker_request_id`).

    The decode worker's messages come `stream_interval` tokens at a time; a request that is not
    streamed and has no stop string (which the router matches as tokens arrive) needs none
    before its end, so it gets one message."""
    interval = request.stream_interval
    if not request.stream and not request.params.stop:
        interval = min(request.params.max_tokens, MAX_STREAM_INTERVAL)
    params = request.params
    if params.num_samples > params.n and params.logprobs is None and not params.use_beam_search:
        # NOTE: best_of ranks samples by their tokens' logprobs: the workers send them
        params = dataclasses.replace(params, logprobs=0)
    return worker_pb2.WorkerRequest(
        request_id=request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_proto(params),
        priority=request.priority,
        cache_salt=request.cache_salt,
        stream_interval=interval,
    )
