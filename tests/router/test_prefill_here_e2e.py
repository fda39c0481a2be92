"""Conditional disaggregation through real processes (redis-server, router, one prefill and one
decode worker, started as `pagedserve up` starts them): prompts the router sends straight to the
decode worker (`--max-local-prefill-tokens`) are computed there, equal transformers, leave no
block held, and a seeded request draws the same tokens whichever path it takes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from support.oracle import hf_greedy, hf_model, make_prompts
from support.probes import blocks_in_use, child, scrape, tokens_of
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.internal.v1 import decode_pb2, decode_pb2_grpc, worker_pb2
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
LOCAL_MAX = 40  # prompts of at most this many tokens are prefilled on the decode worker


@pytest.fixture(scope="module")
def here_and_remote(make_tiny, clusters):
    """`here`: short prompts always go to the decode worker (queue threshold 0); `remote`:
    never (`--max-local-prefill-tokens 0`)."""
    model_dir = make_tiny("llama")
    here_flags = dict(max_local_prefill_tokens=LOCAL_MAX, local_prefill_queue_tokens=0)
    with (
        clusters.private(model_dir, metrics=True, **here_flags) as here,
        clusters.private(model_dir, metrics=True, max_local_prefill_tokens=0) as remote,
    ):
        yield here, remote, model_dir


def test_short_prompts_prefilled_on_the_decode_worker_equal_transformers(here_and_remote):
    here, _, model_dir = here_and_remote
    lens = (1, 5, 16, 17, 30, 40, 41, 47, 64, 80, 3, 9, 33, 100, 12, 20)
    prompts = make_prompts(lens, seed=71)
    router_port = child(here, "router").metrics_port
    prefill_port = child(here, "prefill").metrics_port
    router_before, prefill_before = scrape(router_port), scrape(prefill_port)

    def generate(prompt: list[int]) -> list:
        with Client(here.router_address) as client:
            return list(client.generate(prompt, GREEDY, timeout=120))

    with ThreadPoolExecutor(len(prompts)) as pool:  # NOTE: all at once
        results = list(pool.map(generate, prompts))
    for i, prompt in enumerate(prompts):
        parts = results[i]
        want, _ = hf_greedy(model_dir, torch.float32, tuple(prompt))
        assert tokens_of(parts) == want[: GREEDY.max_tokens], f"prompt {i} of {len(prompt)}"
        assert parts[-1].usage.prompt_tokens == len(prompt)
        assert parts[-1].usage.completion_tokens == GREEDY.max_tokens
        assert parts[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    short = [n for n in lens if n <= LOCAL_MAX]
    router, prefill = scrape(router_port), scrape(prefill_port)
    routed = {
        path: router[f"pagedserve:routes_{path}_total"]
        - router_before.get(f"pagedserve:routes_{path}_total", 0)
        for path in ("prefill_here", "prefill_worker")
    }
    assert routed == {"prefill_here": len(short), "prefill_worker": len(lens) - len(short)}
    # the prefill worker computed the long prompts only
    name = "pagedserve:prompt_tokens_computed_total"
    assert prefill[name] - prefill_before[name] == sum(lens) - sum(short)
    with Client(here.router_address) as client:
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 10.0), (
            "condition not met in time"
        )


def test_a_seeded_request_draws_the_same_tokens_on_either_path(here_and_remote):
    here, remote, _ = here_and_remote
    prompt = make_prompts((30,), seed=72)[0]
    with Client(here.router_address) as client:
        local = list(client.generate(prompt, SEEDED, timeout=60))
        again = list(client.generate(prompt, SEEDED, timeout=60))
    with Client(remote.router_address) as client:
        via_prefill = list(client.generate(prompt, SEEDED, timeout=60))
    assert tokens_of(local) == tokens_of(again) == tokens_of(via_prefill)
    assert len(set(tokens_of(local))) > 3  # sampled, not a constant


@pytest.mark.parametrize("interval", [8, 1 << 16])
def test_the_first_token_comes_alone_with_a_stream_interval_on_either_path(
    here_and_remote, interval
):
    """`stream_interval` counts the tokens after the first: computed on the decode worker, the
    first token still goes out alone, at once (TTFT), as a prefill worker's does."""
    here, remote, model_dir = here_and_remote
    prompt = make_prompts((30,), seed=74)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want, _ = hf_greedy(model_dir, torch.float32, tuple(prompt))
    for started in (here, remote):
        with Client(started.router_address) as client:
            parts = list(client.generate(prompt, params, stream_interval=interval, timeout=60))
        sizes = [len(p.token_ids) for p in parts if p.token_ids]
        assert tokens_of(parts) == want[:24]
        assert sizes[0] == 1 and sum(sizes) == 24, sizes
        assert all(n >= min(interval, 23) for n in sizes[1:-1]), sizes


def test_prefill_here_reports_the_decode_workers_cached_prompt_tokens(here_and_remote):
    here, _, model_dir = here_and_remote
    prompt = make_prompts((37,), seed=73)[0]  # two full blocks of 16, then 5 tokens
    router_metrics = child(here, "router").metrics_port
    before = scrape(router_metrics)
    with Client(here.router_address) as client:
        first = list(client.generate(prompt, GREEDY, timeout=60))
        second = list(client.generate(prompt, GREEDY, timeout=60))
        status = client.status()
    want, _ = hf_greedy(model_dir, torch.float32, tuple(prompt))
    assert tokens_of(first) == tokens_of(second) == want[: GREEDY.max_tokens]
    assert first[-1].usage.cached_prompt_tokens == 0
    assert second[-1].usage.cached_prompt_tokens == 32
    # the cluster's hit rate counts the decode worker's hits too (not only prefill workers')
    after = scrape(router_metrics)
    cached, prompts = (
        after[f"pagedserve:{name}_total"] - before.get(f"pagedserve:{name}_total", 0)
        for name in ("cached_prompt_tokens", "prompt_tokens")
    )
    assert (cached, prompts) == (32, 2 * 37)
    total = after["pagedserve:cached_prompt_tokens_total"] / after["pagedserve:prompt_tokens_total"]
    assert status.prefix_cache_hit_rate == pytest.approx(total, rel=1e-6) and total > 0


def test_prompt_logprobs_come_from_whichever_worker_computed_the_prompt(here_and_remote):
    """A short prompt's prompt logprobs are the decode worker's, a long one's the prefill
    worker's; both equal transformers' (a second run, its blocks cached, too)."""
    here, _, model_dir = here_and_remote
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    for prompt in make_prompts((20, LOCAL_MAX + 30), seed=75):
        with torch.no_grad():
            logits = hf_model(model_dir, torch.float32)(torch.tensor([prompt])).logits[0]
        want = torch.log_softmax(logits, dim=-1)
        with Client(here.router_address) as client:
            for _ in range(2):
                parts = list(client.generate(prompt, params, timeout=60))
                entries = [lp for part in parts for lp in part.prompt_logprobs]
                assert len(entries) == len(prompt) and not entries[0].sampled.HasField("rank")
                got = torch.tensor([lp.sampled.logprob for lp in entries[1:]])
                ref = want[torch.arange(len(prompt) - 1), prompt[1:]]
                assert (got - ref).abs().max() < 1e-4
                assert [len(lp.top) for lp in entries[1:]] == [1] * (len(prompt) - 1)
                assert parts[-1].usage.cached_prompt_tokens == 0


def test_decode_refuses_prefill_here_with_a_prefill_workers_fields(here_and_remote):
    here, _, _ = here_and_remote
    decode = child(here, "decode")
    prompt = make_prompts((8,), seed=74)[0]
    request = worker_pb2.WorkerRequest(
        request_id="bad-here", prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4),
    )  # fmt: skip
    with grpc.insecure_channel(decode.address) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        assert stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10).accepts_prefill_here
        bad = {
            "first_token": decode_pb2.DecodeRequest(
                request=request, prefill_here=True, first_token=5
            ),
            "kv_handle": decode_pb2.DecodeRequest(
                request=request, prefill_here=True, kv_handle=worker_pb2.KvHandle(handle_id="x")
            ),
        }
        for field, message in bad.items():
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Decode(message, timeout=10))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
        two = worker_pb2.WorkerRequest()
        two.CopyFrom(request)
        two.sampling.n = 2
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(decode_pb2.DecodeRequest(request=two, prefill_here=True), timeout=10))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "prefill_here" in err.value.details()
        # and a good one, straight to the worker: the first token is in its stream
        parts = list(stub.Decode(decode_pb2.DecodeRequest(request=request, prefill_here=True)))
        assert sum(len(p.token_ids) for p in parts) == parts[-1].num_generated == 4
