"""The OpenAI-compatible gateway against a real cluster: `pagedserve up --http-port` as the
launcher starts it (redis-server, router with API keys, prefill and decode workers, gateway, all
processes), driven by the official `openai` package (sync and async clients) and plain HTTP.

The reference is the gRPC API of the same router (pagedserve.client): greedy answers through
the gateway are the same tokens, the same text and the same usage.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from support.otlp_receiver import OtlpReceiver
from support.ports import free_port
from support.probes import samples
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.router.tokenizer import RouterTokenizer, read_model_card
from pagedserve.sampling_params import SamplingParams

KEY = "gateway-test-key-0123456789"
CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a colour."},
]
NUM_STREAMS = 200
THREAD_BOUND = 40  # uvicorn + one asyncio loop + grpc's own threads: never one per request


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def cluster(tiny_chat_model, tmp_path_factory, clusters, receiver):
    """A private cluster: its traces go to this module's receiver, which stops with it."""
    keys = tmp_path_factory.mktemp("gateway") / "keys.txt"
    keys.write_text(f"tenant-a:{KEY}\n")
    flags = dict(
        kv_cache_memory="32MiB", http_port=0, api_key_file=str(keys),
        otlp_traces_endpoint=receiver.endpoint,
    )  # fmt: skip
    with clusters.private(tiny_chat_model, **flags) as started:
        yield started, tiny_chat_model


@pytest.fixture(scope="module")
def url(cluster) -> str:
    return cluster[0].http_url


@pytest.fixture(scope="module")
def model_name(cluster) -> str:
    return cluster[1].name


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster[0].router_address, api_key=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(cluster):
    return RouterTokenizer.from_model_dir(cluster[1])


def grpc_chat(grpc_client, messages, **params):
    parts = list(grpc_client.chat(messages, SamplingParams(**params), timeout=60))
    return [t for p in parts for t in p.token_ids], "".join(p.text for p in parts), parts[-1]


def grpc_generate(grpc_client, prompt, **params):
    parts = list(grpc_client.generate(prompt, SamplingParams(**params), timeout=60))
    return [t for p in parts for t in p.token_ids], "".join(p.text for p in parts), parts[-1]


def http(url, path, body=None, headers=None, method=None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, header, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        status, header, raw = err.code, err.headers, err.read()
    try:
        return status, header, json.loads(raw)
    except ValueError:
        return status, header, raw.decode()


def test_models_list_and_retrieve(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_is_the_grpc_api_answer(client, grpc_client, model_name, tokenizer, stream):
    ids, text, last = grpc_chat(grpc_client, CONVERSATION, temperature=0.0, max_tokens=12,
                                logprobs=0)  # fmt: skip
    kwargs = dict(model=model_name, messages=CONVERSATION, temperature=0, max_tokens=12,
                  logprobs=True)  # fmt: skip
    if stream:
        chunks = list(
            client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.content]  # fmt: skip
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == []
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(**kwargs)
        assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
        assert answer.choices[0].message.role == "assistant"
        got = answer.choices[0].message.content
        tokens = [t.token for t in answer.choices[0].logprobs.content]
        finish = answer.choices[0].finish_reason
        usage = answer.usage
    assert got == text
    assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert finish == ("length" if last.finish_reason == 2 else "stop")
    assert usage.prompt_tokens == last.usage.prompt_tokens
    assert usage.completion_tokens == len(ids) == last.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_async_client_equal_the_grpc_api(url, grpc_client, model_name):
    prompts = ["the quick brown fox", [5, 17, 33, 41, 9]]
    expected = [grpc_generate(grpc_client, p, temperature=0.0, max_tokens=10) for p in prompts]
    batch = [prompts[0], "over the lazy dog"]  # NOTE: a list of prompts: one choice each
    expected_batch = [expected[0], grpc_generate(grpc_client, batch[1], temperature=0.0,
                                                 max_tokens=10)]  # fmt: skip

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as c:
            whole = await c.completions.create(
                model=model_name, prompt=batch, temperature=0, max_tokens=10
            )
            streams = []
            for prompt in prompts:
                stream = await c.completions.create(
                    model=model_name, prompt=prompt, temperature=0, max_tokens=10, stream=True
                )
                streams.append("".join([chunk.choices[0].text async for chunk in stream]))
            return whole, streams

    whole, streamed = asyncio.run(run())
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == [text for _, text, _ in expected_batch]
    assert streamed == [text for _, text, _ in expected]
    assert whole.usage.completion_tokens == sum(len(ids) for ids, _, _ in expected_batch)
    assert whole.usage.prompt_tokens == sum(last.usage.prompt_tokens for *_, last in expected_batch)


def test_seeded_sampling_and_vllm_parameters_reach_the_engine(client, grpc_client, model_name):
    params = dict(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, presence_penalty=0.5,
                  frequency_penalty=0.3)  # fmt: skip
    extra = dict(top_k=8, min_p=0.01, repetition_penalty=1.2, ignore_eos=True, min_tokens=6)
    ids, text, _ = grpc_chat(grpc_client, CONVERSATION, **params, **extra)
    answer = client.chat.completions.create(
        model=model_name, messages=CONVERSATION, **params, extra_body=extra, user="someone"
    )
    assert answer.choices[0].message.content == text
    assert answer.usage.completion_tokens == len(ids) == 6
    assert answer.choices[0].finish_reason == "length"


def test_stop_strings_end_the_text(client, grpc_client, model_name):
    _, text, _ = grpc_chat(grpc_client, CONVERSATION, temperature=0.0, max_tokens=16)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short to cut: {text!r}"
    for stops in (stop, [stop, "never-appears"]):
        answer = client.chat.completions.create(
            model=model_name, messages=CONVERSATION, temperature=0, max_tokens=16, stop=stops
        )
        assert answer.choices[0].message.content == text[: text.index(stop)]
        assert answer.choices[0].finish_reason == "stop"
        assert answer.model_extra is not None
        assert answer.choices[0].model_extra["stop_reason"] == stop


def test_logprobs_on_completions(client, grpc_client, model_name, tokenizer):
    ids, _, _ = grpc_generate(grpc_client, "a b c", temperature=0.0, max_tokens=5)
    answer = client.completions.create(
        model=model_name, prompt="a b c", temperature=0, max_tokens=5, logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert len(logprobs.token_logprobs) == 5 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 3 or len(set(top)) < 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_repeated_prompt_reports_cached_tokens(client, model_name):
    long = [{"role": "user", "content": " ".join(["word"] * 80)}]
    first = client.chat.completions.create(model=model_name, messages=long, max_tokens=2)
    again = client.chat.completions.create(model=model_name, messages=long, max_tokens=2)
    before = first.usage.prompt_tokens_details.cached_tokens  # the template's shared opening
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert before < again.usage.prompt_tokens - 16 <= cached < again.usage.prompt_tokens


def test_n_greedy_completions_are_n_copies_of_the_single_answer(client, model_name):
    kwargs = dict(model=model_name, temperature=0, max_tokens=6, logprobs=2,
                  extra_body={"ignore_eos": True})  # fmt: skip
    single = client.completions.create(prompt="a b c", **kwargs)
    three = client.completions.create(prompt="a b c", n=3, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    for choice in three.choices:  # each sample's own logprobs, in its own choice
        assert choice.text == single.choices[0].text
        assert choice.logprobs.tokens == single.choices[0].logprobs.tokens
        # NOTE: a batch of 3 rows need not round like a batch of 1
        assert choice.logprobs.token_logprobs == pytest.approx(
            single.choices[0].logprobs.token_logprobs, abs=1e-4
        )
        assert choice.finish_reason == "length"
    assert three.usage.prompt_tokens == single.usage.prompt_tokens  # one prompt, prefilled once
    assert three.usage.completion_tokens == 3 * single.usage.completion_tokens == 18
    other = client.completions.create(prompt="x y", **kwargs)
    both = client.completions.create(prompt=["a b c", "x y"], n=2, **kwargs)
    texts = [single.choices[0].text] * 2 + [other.choices[0].text] * 2
    assert [(c.index, c.text) for c in both.choices] == list(enumerate(texts))
    assert both.usage.completion_tokens == 4 * 6


def test_chat_samples_with_a_seed_are_reproducible(client, model_name):
    kwargs = dict(model=model_name, messages=CONVERSATION, temperature=1.0, seed=11,
                  max_tokens=8, extra_body={"ignore_eos": True})  # fmt: skip
    first = client.chat.completions.create(n=2, **kwargs)
    again = client.chat.completions.create(n=2, **kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in again.choices] == texts
    assert texts[0] != texts[1], "each sample draws from its own seed"
    single = client.chat.completions.create(**kwargs)
    assert single.choices[0].message.content == texts[0]  # sample 0 draws from `seed` itself
    assert first.usage.completion_tokens == 16


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_samples_are_chunks_of_their_choice(client, model_name, endpoint):
    kwargs = dict(model=model_name, temperature=1.0, seed=5, max_tokens=6, n=2,
                  extra_body={"ignore_eos": True})  # fmt: skip
    if endpoint == "chat":
        create, kwargs = (
            client.chat.completions.create,
            kwargs | {"messages": CONVERSATION, "logprobs": True},
        )
    else:
        create, kwargs = client.completions.create, kwargs | {"prompt": "a b c", "logprobs": 0}
    whole = create(**kwargs)
    chunks = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, tokens, finishes = ["", ""], [[], []], [[], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        if endpoint == "chat":
            texts[choice.index] += choice.delta.content or ""
            tokens[choice.index] += [t.token for t in choice.logprobs.content or ()
                                     ] if choice.logprobs else []  # fmt: skip
        else:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert finishes == [["length"], ["length"]]
    if endpoint == "chat":
        assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
        assert {c.choices[0].index for c in chunks[:2]} == {0, 1}
        assert texts == [c.message.content for c in whole.choices]
        assert tokens == [[t.token for t in c.logprobs.content] for c in whole.choices]
    else:
        assert texts == [c.text for c in whole.choices]
        assert tokens == [c.logprobs.tokens for c in whole.choices]
    assert len(tokens[0]) == len(tokens[1]) == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_best_of_returns_the_most_likely_of_its_samples(client, model_name):
    # NOTE: the first seed whose likeliest sample is not the first, so that ranking shows
    for seed in range(1, 21):
        kwargs = dict(model=model_name, prompt="a b c", temperature=1.0, seed=seed, max_tokens=5,
                      logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
        samples = client.completions.create(n=3, **kwargs).choices  # best_of's, unranked
        ranked = sorted(samples, key=lambda c: -sum(c.logprobs.token_logprobs))
        if ranked[0].index != 0:
            break
    else:
        pytest.fail("no seed in 1-20 makes a later sample the likeliest")
    best = client.completions.create(best_of=3, **kwargs)
    assert [(c.index, c.text) for c in best.choices] == [(0, ranked[0].text)]
    assert best.choices[0].logprobs.token_logprobs == pytest.approx(
        ranked[0].logprobs.token_logprobs, abs=1e-4
    )
    assert best.usage.completion_tokens == 15  # every generated sample, as OpenAI bills
    two = client.completions.create(n=2, best_of=3, **kwargs)
    assert [(c.index, c.text) for c in two.choices] == [(0, ranked[0].text), (1, ranked[1].text)]


BAD = {  # body changes -> the OpenAI parameter the 400 must name
    "temperature": {"temperature": -1},
    "top_p": {"top_p": 1.5},
    "max_tokens": {"max_tokens": 1 << 20},
    "max_completion_tokens": {"max_completion_tokens": 0},
    "n": {"n": 0},
    "logit_bias": {"logit_bias": {"5": 101.0}},
    "top_logprobs": {"top_logprobs": 2},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}] * 2},  # one name twice
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
    "seed": {"seed": -3},
    "messages": {"messages": []},
    "presence_penalty": {"presence_penalty": 9},
    "stop": {"stop": ["x"] * 40},
    "min_tokens": {"min_tokens": 99, "max_tokens": 3},
}


@pytest.mark.parametrize("param", sorted(BAD))
def test_bad_chat_parameters_are_400_naming_them(url, model_name, param):
    body = {"model": model_name, "messages": CONVERSATION, **BAD[param]}
    status, _, answer = http(url, "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [1 << 40]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": -1}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),  # the router's --max-n: 16
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"prompt": "x", "best_of": 17}, "best_of"),
        ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ("/v1/chat/completions", {"messages": CONVERSATION, "n": 17}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_parameter(url, model_name, path, body, param):
    status, _, answer = http(url, path, {"model": model_name, **body},
                             {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_malformed_json_is_400(url):
    status, _, answer = http(url, "/v1/chat/completions", b"{not json",
                             {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"


def test_keys_are_the_routers_to_check(url, model_name):
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key-0123456789", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=model_name, messages=CONVERSATION, max_tokens=2)
    assert info.value.body["type"] == "authentication_error"
    assert info.value.body["code"] == "invalid_api_key"
    body = {"model": model_name, "messages": CONVERSATION, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": f"Basic {KEY}"}):
        status, _, answer = http(url, "/v1/chat/completions", body, headers)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", headers
    assert http(url, "/v1/models", method="GET")[0] == 401


def test_unknown_model_and_route_are_404(client, url):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=CONVERSATION)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    status, _, answer = http(url, "/v1/embeddings", {"model": "x", "input": "y"})
    assert status == 404 and "error" in answer


def test_health_livez_and_metrics(url, model_name):
    assert http(url, "/health", method="GET")[0] == 200
    assert http(url, "/livez", method="GET")[0] == 200
    status, headers, text = http(url, "/metrics", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    model_names: set[str] = set()
    series = samples(text, model_names)
    assert 'pagedserve:gateway_requests_total{endpoint="chat",status="200"}' in series
    assert 'pagedserve:gateway_requests_total{endpoint="chat",status="400"}' in series
    assert model_names == {model_name}  # the model the router serves, on every series


def wait_idle(grpc_client, timeout_s: float) -> bool:
    """Whether, within `timeout_s`, no worker runs a request or holds a used block."""

    def idle() -> bool:
        status = grpc_client.status(timeout=5)
        return all(
            w.load.num_requests_running == 0 and w.load.num_requests_waiting == 0
            and w.load.kv_blocks_free + w.load.kv_blocks_cached == w.load.kv_blocks_total
            for w in status.workers
        )  # fmt: skip

    return wait_until(idle, timeout_s, interval_s=0.05)


def test_a_client_that_disconnects_mid_stream_frees_every_block(url, model_name, grpc_client):
    assert wait_idle(grpc_client, 30)
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as c:
        stream = c.chat.completions.create(
            model=model_name, messages=CONVERSATION, max_tokens=1500, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for count, _ in enumerate(stream):
            if count == 5:
                break
        busy = grpc_client.status(timeout=5)
        assert any(w.load.num_requests_running for w in busy.workers), "the request runs"
        stream.close()
        closed = time.monotonic()
    assert wait_idle(grpc_client, 1.0), "blocks still held a second after the disconnect"
    print(f"freed {time.monotonic() - closed:.3f} s after the disconnect")


def test_a_client_that_leaves_a_non_streamed_request_frees_every_block(url, model_name,
                                                                      grpc_client):  # fmt: skip
    """No stream to break: the gateway watches the connection while it waits for the answer."""
    assert wait_idle(grpc_client, 30)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": model_name, "messages": CONVERSATION, "max_tokens": 1500,
                       "ignore_eos": True}).encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

        def running() -> bool:
            return any(w.load.num_requests_running for w in grpc_client.status(timeout=5).workers)

        assert wait_until(running, 30), "the request runs"
    assert wait_idle(grpc_client, 1.0), "blocks still held a second after the client left"


def gateway_pid(cluster) -> int:
    return next(c.proc.pid for c in cluster[0].children if c.name == "gateway")


def threads(pid: int) -> int:
    """Threads of `pid`. NOTE: the launcher starts children through an orphan guard that
    execs, so the child's pid is the gateway's own."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise RuntimeError("no Threads line")


def test_200_concurrent_streaming_chats_with_bounded_threads(cluster, url, model_name):
    pid = gateway_pid(cluster)
    peak = [threads(pid)]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as c:  # fmt: skip

            async def one(i: int) -> int:
                stream = await c.chat.completions.create(
                    model=model_name, stream=True, max_tokens=8, temperature=0,
                    messages=[{"role": "user", "content": f"request {i}"}],
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                count = 0
                async for chunk in stream:
                    count += bool(chunk.choices and chunk.choices[0].delta.content)
                    peak.append(threads(pid))
                return count

            return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))

    counts = asyncio.run(run())
    assert len(counts) == NUM_STREAMS and all(n >= 1 for n in counts)
    print(f"gateway threads: start {peak[0]}, peak {max(peak)}")
    assert max(peak) <= THREAD_BOUND


def test_one_trace_per_request_from_the_gateway_down(client, model_name, receiver):
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    client.chat.completions.create(
        model=model_name, messages=CONVERSATION, max_tokens=3,
        extra_headers={"traceparent": traceparent},
    )  # fmt: skip
    trace_id = "0af7651916cd43dd8448eb211c80319c"

    def gateway_and_its_child() -> bool:
        """NOTE: each service exports its spans when they end, in batches: the router's
        `router.route` may arrive before its parent `router.generate`, so wait for the child."""
        spans = [s for s in receiver.spans if s.trace_id == trace_id]
        gateway = [s.span_id for s in spans if s.service == "pagedserve-gateway"]
        return any(s.parent_span_id in gateway for s in spans if s.service == "pagedserve-router")

    done = wait_until(gateway_and_its_child, 15)
    spans = [s for s in receiver.spans if s.trace_id == trace_id]
    assert done, [(s.service, s.name, s.span_id, s.parent_span_id) for s in spans]
    gateway = next(s for s in spans if s.service == "pagedserve-gateway")
    assert gateway.parent_span_id == "b7ad6b7169203331"


def start_gateway(router: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = open(tmp_path / "gateway.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "gateway", "--router", router, "--port", "0"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("READY gateway"), (tmp_path / "gateway.log").read_text()
    return proc, line.split()[2]


def start_router(cluster, extra: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str]:
    started, model_dir = cluster
    workers = []
    for child in started.children:
        if child.name.startswith(("prefill", "decode")):
            workers += [f"--{child.name.split('-')[0]}", child.address]
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = open(tmp_path / "router.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "router", "--model", str(model_dir),
         "--port", "0", *workers, *extra],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("READY"), (tmp_path / "router.log").read_text()
    return proc, line.split()[2]


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_an_overloaded_router_is_429_with_retry_after(cluster, model_name, tmp_path):
    router, address = start_router(cluster, ["--max-queued-requests", "1"], tmp_path)
    gateway, url = start_gateway(address, tmp_path)
    try:
        assert wait_until(lambda: http(url, "/health", method="GET")[0] == 200, 30)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
            holder = c.chat.completions.create(
                model=model_name, messages=CONVERSATION, max_tokens=1500, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            next(iter(holder))  # admitted: the router's one place is taken
            status, headers, answer = http(
                url, "/v1/chat/completions", {"model": model_name, "messages": CONVERSATION}
            )
            holder.close()
        assert status == 429, answer
        assert headers["Retry-After"] == "1"
        assert answer["error"]["type"] == "rate_limit_error"
        assert answer["error"]["code"] == "rate_limit_exceeded"
    finally:
        stop(gateway, router)


def test_a_router_that_is_down_is_503(model_name, tmp_path):
    gateway, url = start_gateway(f"127.0.0.1:{free_port()}", tmp_path)
    try:
        status, _, answer = http(url, "/health", method="GET")
        assert status == 503 and answer["error"]["type"] == "service_unavailable"
        assert http(url, "/livez", method="GET")[0] == 200
        status, _, answer = http(url, "/v1/chat/completions",
                                 {"model": model_name, "messages": CONVERSATION})  # fmt: skip
        assert status == 503, answer
        assert answer["error"]["type"] == "service_unavailable"
    finally:
        stop(gateway)


def test_a_gateway_spreads_requests_over_every_router(cluster, model_name, tmp_path):
    """`--router` naming several routers (a headless Service in Kubernetes): round-robin."""
    ports = [free_port(), free_port()]
    routers = [
        start_router(cluster, ["--metrics-port", str(port)], tmp_path / str(i))
        for i, port in enumerate(ports)
    ]
    target = "ipv4:" + ",".join(address for _, address in routers)
    gateway, url = start_gateway(target, tmp_path)
    try:
        assert wait_until(lambda: http(url, "/health", method="GET")[0] == 200, 30)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
            for _ in range(6):
                c.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=2)
        for port in ports:
            status, _, text = http(f"http://127.0.0.1:{port}", "/metrics", method="GET")
            served = [line for line in text.splitlines()
                      if line.startswith("pagedserve:request_success_total{")]  # fmt: skip
            assert sum(float(line.rsplit(" ", 1)[1]) for line in served) >= 2, port
    finally:
        stop(gateway, *(proc for proc, _ in routers))


# ---- vLLM's /tokenize, /detokenize and /version, through the openai SDK's own HTTP client ----


def sdk_post(client, url, path, body):
    """POST `body` to a non-OpenAI route with the SDK's client (its key, its error classes)."""
    return client.post(f"{url}{path}", body=body, cast_to=object)


def test_tokenize_a_prompt_and_detokenize_it_back(client, url, model_name, tokenizer):
    text = "Hello world, héllo ✓"
    answer = sdk_post(client, url, "/tokenize", {"model": model_name, "prompt": text})
    ids = tokenizer.encode(text, add_special_tokens=True)
    max_model_len = client.models.retrieve(model_name).max_model_len
    assert answer == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                      "token_strs": None}  # fmt: skip
    bare = sdk_post(client, url, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                "return_token_strs": True})  # fmt: skip
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert len(bare["token_strs"]) == bare["count"] and all(bare["token_strs"])
    back = sdk_post(client, url, "/detokenize", {"model": model_name, "tokens": bare["tokens"]})
    assert back == {"prompt": text}


def test_tokenize_a_chat_counts_the_chat_completions_prompt(client, url, model_name, tokenizer):
    """The chat form renders with the template as /v1/chat/completions does: the same ids."""
    body = {"model": model_name, "messages": CONVERSATION}
    answer = sdk_post(client, url, "/tokenize", body)
    completion = client.chat.completions.create(
        model=model_name, messages=CONVERSATION, max_tokens=1, temperature=0
    )
    assert answer["count"] == completion.usage.prompt_tokens == len(answer["tokens"])
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
             for m in CONVERSATION]  # fmt: skip
    assert sdk_post(client, url, "/tokenize", {**body, "messages": parts}) == answer
    without = sdk_post(client, url, "/tokenize", {**body, "add_generation_prompt": False})
    assert answer["tokens"][: without["count"]] == without["tokens"]
    assert without["count"] < answer["count"]
    text = sdk_post(client, url, "/detokenize", {"tokens": answer["tokens"]})["prompt"]
    assert text.endswith("<|im_start|>assistant\n")  # special tokens written out, as vLLM


def test_version_is_the_package_version(client, url):
    from pagedserve import __version__

    assert client.get(f"{url}/version", cast_to=object) == {"version": __version__}
    assert http(url, "/version", method="GET")[:3:2] == (200, {"version": __version__})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": CONVERSATION, "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"messages": CONVERSATION, "continue_final_message": True},
         "continue_final_message"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, "VOCAB"]}, "tokens"),
        ("/detokenize", {"tokens": [1 << 40]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)  # fmt: skip
def test_bad_tokenizer_requests_are_400_naming_the_field(client, url, cluster, path, body, param):
    if body.get("tokens") == [1, "VOCAB"]:  # the first id out of the model's vocabulary
        body = {"tokens": [1, read_model_card(cluster[1]).vocab_size]}
    with pytest.raises(openai.BadRequestError) as info:
        sdk_post(client, url, path, body)
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error"
    if path == "/detokenize" and body.get("tokens", [0])[-1] > 0:
        assert "out of vocabulary" in info.value.body["message"]


def test_tokenizer_routes_check_the_model_and_the_key(client, url):
    with pytest.raises(openai.NotFoundError) as info:
        sdk_post(client, url, "/tokenize", {"model": "gpt-5", "prompt": "x"})
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    status, _, answer = http(url, "/detokenize", {"tokens": [1]})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, _, answer = http(url, "/tokenize", b"{not json", {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
