"""`echo` on `/v1/completions`: each choice starts with its prompt, in the text and, with
`logprobs`, in the logprobs (vLLM's and OpenAI's legacy shape), which is how evaluation
harnesses (lm-eval's `local-completions`) score a prompt's tokens (docs/evaluation.md).

    request  {"prompt": ..., "echo": true, "logprobs": N, "max_tokens": 1}
       └─► GenerateRequest.sampling.prompt_logprobs = N (the router's workers compute them)
    choice   text:     prompt text + generated text
             logprobs: prompt tokens (the first: null) + generated tokens

The prompt text is the request's own string, or for token ids the router's `Detokenize` of them
(special tokens written out). `max_tokens: 0` (echo only) generates one token and drops it: the
choice is the prompt alone and `usage.completion_tokens` is 0.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc

from pagedserve.gateway.errors import from_rpc_error
from pagedserve.gateway.protocol import CompletionRequest
from pagedserve.gateway.responses import Choice
from pagedserve.v1 import generation_pb2


@dataclass(frozen=True, slots=True)
class Echo:
    """What an `echo` request puts before each of its choices."""

    texts: list[str]  # by prompt: the text its choices start with
    generated: bool  # False for max_tokens 0: the prompt alone


async def echo_of(
    body: object, stub: Any, md: list[tuple[str, str]], timeout: float | None
) -> Echo | None:
    """The echo of a completions request that asks for one (None otherwise): each prompt's
    text is itself, or the router's detokenization of its ids (a 400 naming `prompt` for an
    id out of the vocabulary)."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None

    async def text_of(prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        request = generation_pb2.DetokenizeRequest(token_ids=prompt)
        try:
            answer = await stub.Detokenize(request, metadata=md, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, lambda _: "prompt") from None
        return answer.text

    texts = await asyncio.gather(*(text_of(p) for p in body.prompts()))
    return Echo(list(texts), generated=body.max_tokens != 0)


def echo_choices(echo: Echo | None, choices: list[Choice], samples: int) -> Echo | None:
    """Set each of `choices` (prompt p's sample i is choice p * samples + i) to start with its
    prompt; returns `echo`. Nothing to do without one."""
    if echo is not None:
        for choice in choices:
            choice.echo = echo.texts[choice.index // samples]
            choice.keep_generated = echo.generated
    return echo


def echo_usage(echo: Echo | None, used: dict[str, Any]) -> dict[str, Any]:
    """`used` as the client sees it: a token generated and dropped (max_tokens 0) was not
    returned, so it is not counted."""
    if echo is None or echo.generated:
        return used
    return used | {"completion_tokens": 0, "total_tokens": used["prompt_tokens"]}
