"""GenerateRequest building, shared by Client and AsyncClient."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve_client.v1 import common_pb2, generation_pb2


def generate_request(
    prompt: str | Sequence[int], options: Mapping[str, Any], sampling: Mapping[str, Any]
) -> generation_pb2.GenerateRequest:
    """A streaming request for a text (tokenized by the router) or token ids. `options`: fields
    of GenerateRequest (request_id, priority, cache_salt, stream_interval, add_special_tokens,
    ...); `sampling`: fields of SamplingParams (max_tokens, temperature, stop, seed, ...).
    ValueError names an unknown field; TypeError a value of the wrong type."""
    request = _request(options, sampling)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def chat_request(
    messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any], sampling: Mapping[str, Any]
) -> generation_pb2.GenerateRequest:
    """A streaming request for a conversation: each message a mapping of ChatMessage fields
    (`role`, `content`, and `name`, `tool_call_id`, `tool_calls` where needed), oldest first."""
    request = _request(options, sampling)
    request.messages.SetInParent()  # NOTE: selects the oneof even for an empty list
    for message in messages:
        request.messages.messages.append(generation_pb2.ChatMessage(**message))
    return request


def _request(
    options: Mapping[str, Any], sampling: Mapping[str, Any]
) -> generation_pb2.GenerateRequest:
    set_options = {name: value for name, value in options.items() if value is not None}
    return generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(**sampling), stream=True, **set_options
    )
