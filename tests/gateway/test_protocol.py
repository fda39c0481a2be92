"""The gateway's translation layer without processes: OpenAI bodies -> GenerateRequests, router
responses -> OpenAI JSON, router statuses -> OpenAI errors."""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from pydantic import ValidationError

from pagedserve.gateway import responses as out
from pagedserve.gateway.app import choice_index, choices_of
from pagedserve.gateway.errors import GatewayError, from_rpc_error
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.v1 import common_pb2, generation_pb2

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body
    )


def test_chat_maps_every_sampling_parameter():
    request = chat(
        temperature=0.5, top_p=0.9, seed=3, stop="END", presence_penalty=0.1,
        frequency_penalty=0.2, max_completion_tokens=7, max_tokens=99, logprobs=True,
        top_logprobs=4, top_k=-1, min_p=0.05, repetition_penalty=1.1, ignore_eos=True,
        min_tokens=2, stop_token_ids=[9], skip_special_tokens=False, priority=-5,
        cache_salt="tenant", stream=True, user="u", unknown_field=1,
    ).generate_requests("chatcmpl-1")[0]  # fmt: skip
    s = request.sampling
    assert (s.temperature, s.seed, s.max_tokens, s.logprobs, s.top_k) == (0.5, 3, 7, 4, 0)
    assert list(s.stop) == ["END"] and list(s.stop_token_ids) == [9]
    assert s.ignore_eos and s.min_tokens == 2 and not s.skip_special_tokens
    assert abs(s.top_p - 0.9) < 1e-6 and abs(s.min_p - 0.05) < 1e-6
    assert abs(s.repetition_penalty - 1.1) < 1e-6 and abs(s.frequency_penalty - 0.2) < 1e-6
    assert (request.priority, request.cache_salt, request.stream) == (-5, "tenant", True)
    assert request.request_id == "chatcmpl-1" and request.max_tokens_to_fit


def test_chat_leaves_unset_parameters_to_the_router():
    request = chat().generate_requests("id")[0]
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs"):
        assert not request.sampling.HasField(name), name
    assert request.max_tokens_to_fit  # OpenAI chat: the rest of the context
    assert chat(logprobs=True).generate_requests("id")[0].sampling.logprobs == 0


def test_chat_messages_roles_and_text_parts():
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        add_generation_prompt=False, continue_final_message=True,
    ).generate_requests("id")[0]  # fmt: skip
    turns = [(m.role, m.content) for m in request.messages.messages]
    assert turns == [("system", "be brief"), ("user", "a\nb"), ("assistant", "")]
    assert request.HasField("add_generation_prompt") and not request.add_generation_prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"one": 2}}, "logit_bias"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [F, F]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [F], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "a+", "guided_choice": ["x"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_do_is_400_naming_it(body, param):
    with pytest.raises(GatewayError) as info:
        chat(**body).generate_requests("id")
    assert (info.value.status, info.value.param) == (400, param)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("body", "source", "kind", "spec"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                     "strict": True}}},
         "response_format", "json_schema", SCHEMA),
        ({"response_format": {"type": "json_object"}}, "response_format", "json", True),
        ({"guided_json": SCHEMA}, "guided_json", "json_schema", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "guided_json", "json_schema", SCHEMA),
        ({"guided_regex": "[ab]+"}, "guided_regex", "regex", "[ab]+"),
        ({"guided_choice": ["yes", "no"]}, "guided_choice", "choice", ["yes", "no"]),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", "json_schema", SCHEMA),
        ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs", "choice", ["a"]),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs", "json", True),
    ],
)  # fmt: skip
def test_every_structured_output_parameter_becomes_one_grammar(body, source, kind, spec):
    for request in (chat(**body), CompletionRequest.model_validate({"model": "m", "prompt": "p"}
                                                                   | body)):  # fmt: skip
        grammar = request.generate_requests("id")[0].sampling.structured_output
        assert grammar.WhichOneof("kind") == kind
        value = getattr(grammar, kind)
        got = {"json_schema": json.loads, "choice": lambda c: list(c.choices)}.get(
            kind, lambda v: v
        )
        assert got(value) == spec
        # the router's errors about it name the parameter it came from
        assert request.param_of(f"sampling.structured_output.{kind}") == source


def test_text_response_format_is_no_grammar_and_logits_controls_map():
    request = chat(response_format={"type": "text"}, logit_bias={"5": -100, "7": 2.5},
                   allowed_token_ids=[1, 2], use_beam_search=True, length_penalty=0.5)  # fmt: skip
    sampling = request.generate_requests("id")[0].sampling
    assert not sampling.HasField("structured_output")
    assert dict(sampling.logit_bias) == {5: -100.0, 7: 2.5}
    assert list(sampling.allowed_token_ids) == [1, 2]
    assert sampling.use_beam_search and sampling.length_penalty == 0.5
    assert request.param_of("sampling.logit_bias") == "logit_bias"


@pytest.mark.parametrize("body", [{"seed": -1}, {"max_tokens": 0}, {"min_tokens": -2},
                                  {"top_k": -2}, {"stop_token_ids": [-1]}])  # fmt: skip
def test_what_protos_cannot_carry_fails_validation(body):
    with pytest.raises(ValidationError) as info:
        chat(**body)
    assert info.value.errors()[0]["loc"][0] == next(iter(body))


def test_completion_prompts_become_one_request_each():
    body = {"model": "m", "logprobs": 2, "add_special_tokens": False}
    single = CompletionRequest.model_validate(body | {"prompt": "hi"}).generate_requests("c")
    assert [(r.text, r.add_special_tokens, r.sampling.logprobs) for r in single] == [
        ("hi", False, 2)
    ]
    ids = CompletionRequest.model_validate(body | {"prompt": [1, 2]}).generate_requests("c")
    assert [list(r.token_ids.ids) for r in ids] == [[1, 2]]
    many = CompletionRequest.model_validate(body | {"prompt": [[1], [2, 3]]})
    requests = many.generate_requests("c")
    assert [r.request_id for r in requests] == ["c", "c-1"]
    assert not requests[0].max_tokens_to_fit  # completions: OpenAI's default of 16
    with pytest.raises(GatewayError):
        CompletionRequest.model_validate(body | {"prompt": ["x"] * 65}).generate_requests("c")
    with pytest.raises(GatewayError):
        CompletionRequest.model_validate(body | {"prompt": []}).generate_requests("c")


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | body)


def test_n_and_best_of_travel_in_one_request_per_prompt():
    request = completion(n=2, best_of=5).generate_requests("c")[0]
    assert (request.sampling.n, request.sampling.best_of) == (2, 5)
    many = completion(prompt=["a", "b"], n=3).generate_requests("c")
    assert [(r.text, r.sampling.n, r.sampling.HasField("best_of")) for r in many] == [
        ("a", 3, False), ("b", 3, False)
    ]  # fmt: skip
    assert chat(n=4).generate_requests("id")[0].sampling.n == 4
    unset = completion().generate_requests("c")[0].sampling
    assert not unset.HasField("n") and not unset.HasField("best_of")
    assert (completion().samples, completion(n=None).samples, chat(n=3).samples) == (1, 1, 3)


def test_best_of_above_n_cannot_be_streamed():
    with pytest.raises(GatewayError) as info:
        completion(n=2, best_of=3, stream=True).generate_requests("c")
    assert (info.value.status, info.value.param) == (400, "best_of")
    assert "stream" in info.value.message
    for body in ({"n": 2, "best_of": 2}, {"best_of": 1}, {"n": 3}):  # nothing to rank: streams
        assert completion(stream=True, **body).generate_requests("c")[0].stream
    assert not completion(best_of=3).generate_requests("c")[0].stream


@pytest.mark.parametrize("body", [{"n": -1}, {"best_of": -2}, {"n": 1 << 32}])
def test_sample_counts_the_protos_cannot_carry_fail_validation(body):
    with pytest.raises(ValidationError) as info:
        completion(**body)
    assert info.value.errors()[0]["loc"][0] == next(iter(body))


def test_router_fields_become_openai_parameters():
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert completion.param_of("token_ids") == completion.param_of("text") == "prompt"
    assert completion.param_of("sampling.logprobs") == "logprobs"
    assert chat().param_of("sampling.logprobs") == "top_logprobs"
    assert chat().param_of("sampling.top_p") == "top_p"
    assert chat().param_of("messages.content") == "messages"
    assert chat(max_completion_tokens=3).param_of("sampling.max_tokens") == "max_completion_tokens"
    assert chat(max_tokens=3).param_of("sampling.max_tokens") == "max_tokens"
    assert chat().param_of("request_id") is None
    assert chat().param_of("sampling.n") == completion.param_of("sampling.n") == "n"
    assert completion.param_of("sampling.best_of") == "best_of"


def rpc_error(code: grpc.StatusCode, message: str, *details) -> grpc.aio.AioRpcError:
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, message)


def test_invalid_argument_is_400_naming_the_parameter():
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="sampling.top_p", description="must be in (0, 1]")
    error = from_rpc_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad", bad), chat().param_of)
    assert (error.status, error.param, error.type) == (400, "top_p", "invalid_request_error")
    assert error.message == "top_p: must be in (0, 1]"
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error",
                                      "param": "top_p", "code": None}}  # fmt: skip


def test_resource_exhausted_is_429_with_retry_after():
    delay = duration_pb2.Duration(seconds=2, nanos=500_000_000)
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    full = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", info)
    error = from_rpc_error(full, chat().param_of)
    assert (error.status, error.code, error.headers()) == (429, "rate_limit_exceeded",
                                                           {"Retry-After": "3"})  # fmt: skip
    bare = from_rpc_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), chat().param_of)
    assert bare.headers() == {"Retry-After": "1"}


@pytest.mark.parametrize(
    ("code", "status"),
    [(grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.PERMISSION_DENIED, 403),
     (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
     (grpc.StatusCode.ALREADY_EXISTS, 409), (grpc.StatusCode.INTERNAL, 500)],
)  # fmt: skip
def test_status_codes_map_to_http(code, status):
    assert from_rpc_error(rpc_error(code, "x"), chat().param_of).status == status


def test_a_detail_that_disagrees_with_the_code_is_ignored():
    status = status_pb2.Status(code=code_pb2.INTERNAL, message="x")
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    err = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), trailers, "x")
    error = from_rpc_error(err, chat().param_of)
    assert (error.status, error.param) == (400, None)


def part(text: str, ids: list[int], finish: int = 0, **usage) -> generation_pb2.GenerateResponse:
    message = generation_pb2.GenerateResponse(
        request_id="r", token_ids=ids, text=text, finish_reason=finish,
        usage=common_pb2.Usage(**usage),
    )  # fmt: skip
    for token in ids:
        lp = message.logprobs.add()
        lp.sampled.CopyFrom(common_pb2.TokenLogprob(token_id=token, logprob=float("-inf"),
                                                    token=f"t{token}é"))  # fmt: skip
        lp.top.add(token_id=token, logprob=-0.5, token=f"t{token}é")
    return message


def test_usage_sums_choices_and_reports_cached_tokens():
    parts = [part("", [], prompt_tokens=5, completion_tokens=2, cached_prompt_tokens=4),
             part("", [], prompt_tokens=3, completion_tokens=1)]  # fmt: skip
    assert out.usage(parts) == {
        "prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }  # fmt: skip


def test_choices_number_prompts_times_samples_and_usage_counts_each_request_once():
    """vLLM's numbering: prompt p's sample i is choice p * n + i; each request's latest usage
    already counts all of its samples, so it is added once per request, never per choice."""
    answers = [
        [part("a0", [1], 1, prompt_tokens=4, completion_tokens=3),
         part("a1", [2, 3], 2, prompt_tokens=4, completion_tokens=3)],
        [part("b0", [4], 1, prompt_tokens=2, completion_tokens=2),
         part("b1", [5], 1, prompt_tokens=2, completion_tokens=2)],
    ]  # fmt: skip
    for answer in answers:
        answer[1].index = 1
    choices = choices_of(answers, samples=2)
    env = out.Envelope("cmpl-x", 1, "m", logprobs=True)
    body = out.completion(env, choices, out.usage(a[-1] for a in answers))
    got = [(c["index"], c["text"], c["logprobs"]["tokens"], c["finish_reason"])
           for c in body["choices"]]  # fmt: skip
    assert got == [(0, "a0", ["t1é"], "stop"), (1, "a1", ["t2é", "t3é"], "length"),
                   (2, "b0", ["t4é"], "stop"), (3, "b1", ["t5é"], "stop")]  # fmt: skip
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 5
    stray = part("x", [1])
    stray.index = 2
    with pytest.raises(RuntimeError):
        choice_index(0, stray, samples=2)


def test_logprobs_shapes_and_no_infinity_in_json():
    message = part("ab", [1, 2])
    chat_lp = out.chat_logprobs(message.logprobs)
    first = chat_lp["content"][0]
    assert first["token"] == "t1é" and first["bytes"] == list("t1é".encode())
    assert first["logprob"] == out.MIN_LOGPROB
    assert first["top_logprobs"] == [{"token": "t1é", "logprob": -0.5, "bytes": first["bytes"]}]
    json.dumps(chat_lp, allow_nan=False)
    legacy = out.CompletionLogprobs()
    assert legacy.add(message.logprobs)["text_offset"] == [0, 3]
    assert legacy.add(part("c", [3]).logprobs)["text_offset"] == [6]  # across chunks


def test_chat_chunks_open_with_the_role_and_end_with_the_reason():
    env = out.Envelope("chatcmpl-x", 1, "m", logprobs=False)
    choice = out.Choice(0)
    opening = out.chat_chunk(env, choice, None, first=True)
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = part("end", [4], common_pb2.FINISH_REASON_STOP)
    last.stop_string = "STOP"
    choice.add(last)
    chunk = out.chat_chunk(env, choice, last)
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0] | {} == {
        "index": 0, "delta": {"content": "end"}, "logprobs": None, "finish_reason": "stop",
        "stop_reason": "STOP",
    }  # fmt: skip
    assert out.sse(chunk).startswith(b"data: {") and out.sse("[DONE]") == b"data: [DONE]\n\n"


def test_the_gateway_socket_turns_nagle_off_for_every_connection():
    """SSE chunks are small writes: with Nagle on, each waits for the client's delayed ACK."""
    import asyncio
    import socket

    from pagedserve.gateway.server import listening_socket

    async def accepted_nodelay() -> int:
        sock = listening_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            raw = writer.get_extra_info("socket")
            seen.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
