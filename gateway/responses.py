"""The router's `GenerateResponse`s as OpenAI JSON: whole responses, stream chunks, usage and
logprobs, in the shapes of the OpenAI API reference (plus vLLM's `stop_reason`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.gateway.tools import Call, ToolPlan
from pagedserve.v1 import common_pb2, generation_pb2

Tools = tuple[ToolPlan, str]

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
MIN_LOGPROB = -9999.0  # NOTE: JSON has no -inf; vLLM clamps the same way


def finish_reason(part: generation_pb2.GenerateResponse) -> str | None:
    return _FINISH.get(part.finish_reason)


def stop_reason(part: generation_pb2.GenerateResponse) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token that ended the choice."""
    which = part.WhichOneof("matched_stop")
    return getattr(part, which) if which else None


def usage(parts: Iterable[generation_pb2.GenerateResponse]) -> dict[str, Any]:
    """OpenAI usage summed over the latest (cumulative) usage of each `GenerateRequest`: pass
    one message per request (a request's usage already counts every one of its samples)."""
    prompt = completion = cached = 0
    for part in parts:
        prompt += part.usage.prompt_tokens
        completion += part.usage.completion_tokens
        cached += part.usage.cached_prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _entry(token: common_pb2.TokenLogprob) -> dict[str, Any]:
    return {
        "token": token.token,
        "logprob": _logprob(token.logprob),
        "bytes": list(token.token.encode("utf-8")),
    }


def chat_logprobs(logprobs: Iterable[common_pb2.Logprobs]) -> dict[str, Any]:
    return {
        "content": [
            _entry(lp.sampled) | {"top_logprobs": [_entry(top) for top in lp.top]}
            for lp in logprobs
        ]
    }


@dataclass(slots=True)
class CompletionLogprobs:
    """The legacy completions shape, kept across chunks (`text_offset` counts from the start of
    the choice's text)."""

    offset: int = 0

    def add(self, logprobs: Iterable[common_pb2.Logprobs]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        for lp in logprobs:
            out["tokens"].append(lp.sampled.token)
            if not lp.sampled.HasField("rank"):  # NOTE: an echoed prompt's first token: none
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(_logprob(lp.sampled.logprob))
                out["top_logprobs"].append({t.token: _logprob(t.logprob) for t in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(lp.sampled.token)
        return out


@dataclass(slots=True)
class Choice:
    """One choice's output so far (a streamed choice keeps only what it has not sent)."""

    index: int
    text: str = ""
    logprobs: list[common_pb2.Logprobs] = field(default_factory=list)
    last: generation_pb2.GenerateResponse | None = None
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    echo: str | None = None  # completions' echo: the prompt text, put before the first part's
    keep_generated: bool = True  # False: echo with max_tokens 0 (the prompt alone)

    def add(self, part: generation_pb2.GenerateResponse) -> None:
        if self.echo is not None:
            self.text, self.echo = self.text + self.echo, None
        self.logprobs.extend(part.prompt_logprobs)  # NOTE: on a sample's first part only
        if self.keep_generated:
            self.text += part.text
            self.logprobs.extend(part.logprobs)
        self.last = part

    def take(self) -> tuple[str, list[common_pb2.Logprobs]]:
        text, logprobs = self.text, self.logprobs
        self.text, self.logprobs = "", []
        return text, logprobs


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every response and chunk of one request shares."""

    id: str
    created: int
    model: str
    logprobs: bool  # whether the client asked for logprobs

    def head(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id, "object": kind, "created": self.created, "model": self.model,
            "system_fingerprint": None,
        }  # fmt: skip


def completion(env: Envelope, choices: list[Choice], used: dict[str, Any]) -> dict[str, Any]:
    out = env.head("text_completion")
    out["choices"] = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": c.completion_logprobs.add(c.logprobs) if env.logprobs else None,
            "finish_reason": finish_reason(c.last) if c.last else None,
            "stop_reason": stop_reason(c.last) if c.last else None,
        }
        for c in choices
    ]
    out["usage"] = used
    return out


def chat_completion(
    env: Envelope, choices: list[Choice], used: dict[str, Any], tools: Tools | None = None
) -> dict[str, Any]:
    """`tools`: (the request's ToolPlan, the model's tool-call parser) when it has tools."""
    out = env.head("chat.completion")
    out["choices"] = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
        reason = finish_reason(c.last) if c.last else None
        if tools is not None and tools[0].active:
            content, calls = tools[0].parse(c.text, tools[1])
            if calls:
                message |= {"content": content, "tool_calls": [call.openai() for call in calls]}
                reason = "tool_calls" if reason == "stop" else reason
        out["choices"].append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs) if env.logprobs else None,
            "finish_reason": reason,
            "stop_reason": stop_reason(c.last) if c.last else None,
        })  # fmt: skip
    out["usage"] = used
    return out


def tool_calls_chunk(
    env: Envelope, choice: Choice, calls: list[Call], part: generation_pb2.GenerateResponse
) -> dict[str, Any]:
    """The chunk that carries a streamed choice's calls, whole, at its end."""
    reason = finish_reason(part)
    out = env.head("chat.completion.chunk")
    out["choices"] = [{
        "index": choice.index,
        "delta": {"tool_calls": [call.openai(i) for i, call in enumerate(calls)]},
        "logprobs": None,
        "finish_reason": "tool_calls" if reason == "stop" else reason,
        "stop_reason": stop_reason(part),
    }]  # fmt: skip
    return out


def completion_chunk(
    env: Envelope, choice: Choice, part: generation_pb2.GenerateResponse
) -> dict[str, Any]:
    text, logprobs = choice.take()
    out = env.head("text_completion")
    out["choices"] = [
        {
            "index": choice.index,
            "text": text,
            "logprobs": choice.completion_logprobs.add(logprobs) if env.logprobs else None,
            "finish_reason": finish_reason(part),
            "stop_reason": stop_reason(part),
        }
    ]
    return out


def chat_chunk(
    env: Envelope,
    choice: Choice,
    part: generation_pb2.GenerateResponse | None,
    *,
    first: bool = False,
) -> dict[str, Any]:
    """A delta chunk; `first` is the one that opens the assistant's message (role only)."""
    out = env.head("chat.completion.chunk")
    if first or part is None:
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        entry = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
    else:
        text, logprobs = choice.take()
        entry = {
            "index": choice.index,
            "delta": {"content": text} if text else {},
            "logprobs": chat_logprobs(logprobs) if env.logprobs and logprobs else None,
            "finish_reason": finish_reason(part),
            "stop_reason": stop_reason(part),
        }
    out["choices"] = [entry]
    return out


def usage_chunk(env: Envelope, kind: str, used: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of `stream_options.include_usage`: no choices, the request's usage."""
    out = env.head(kind)
    out["choices"] = []
    out["usage"] = used
    return out


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
