"""Several samples of one prompt (SamplingParams n / best_of) through real processes:
redis-server, the router, one prefill and one decode worker started by `pagedserve up`'s code,
driven over the public gRPC API. The prompt is prefilled once; the decode worker forks it."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.clusters import SAMPLES_MAX_N
from support.oracle import hf_beams, hf_greedy, make_prompts
from support.probes import blocks_in_use, tokens_of
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.protoconv import sampling_to_proto
from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture(scope="module")
def cluster(make_tiny, clusters):
    """The shared tiny cluster, with `max_n` raised to `SAMPLES_MAX_N` (6)."""
    model_dir = make_tiny("llama")
    return clusters.get(model_dir, max_n=SAMPLES_MAX_N), model_dir


def by_index(parts) -> dict[int, list]:
    out: dict[int, list] = {}
    for part in parts:
        out.setdefault(part.index, []).append(part)
    return out


def test_greedy_samples_equal_transformers_each(cluster) -> None:
    started, model_dir = cluster
    prompt = make_prompts((37,), seed=41)[0]
    want, _ = hf_greedy(model_dir, torch.float32, tuple(prompt))
    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    with Client(started.router_address) as client:
        parts = list(client.generate(prompt, dataclasses.replace(GREEDY, n=3), timeout=120))
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 5.0), (
            "condition not met in time"
        )
    samples = by_index(parts)
    assert sorted(samples) == [0, 1, 2]
    for index, mine in samples.items():
        assert tokens_of(mine) == want[: GREEDY.max_tokens], f"sample {index}"
        assert "".join(p.text for p in mine) == tokenizer.decode(tokens_of(mine))
        finishes = [p.finish_reason for p in mine if p.finish_reason]
        assert finishes == [common_pb2.FINISH_REASON_LENGTH], f"sample {index}"
    last = parts[-1]
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == 3 * GREEDY.max_tokens


def test_seeded_samples_are_reproducible_differ_and_merge_per_sample(cluster) -> None:
    started, _ = cluster
    prompt = make_prompts((25,), seed=42)[0]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, n=4, ignore_eos=True)
    with Client(started.router_address) as client:
        runs = []
        for _ in range(2):
            parts = list(client.generate(prompt, params, timeout=120))
            runs.append({i: tokens_of(p) for i, p in by_index(parts).items()})
        # not streamed: one message per sample, by index
        request = generation_pb2.GenerateRequest(sampling=sampling_to_proto(params), stream=False)
        request.token_ids.ids.extend(prompt)
        merged = list(client.stub.Generate(request, timeout=120))
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0].values()}) == 4, "the samples must differ"
    assert [m.index for m in merged] == [0, 1, 2, 3]
    assert {m.index: list(m.token_ids) for m in merged} == runs[0]
    assert all(m.usage.completion_tokens == 64 for m in merged)


def test_best_of_returns_the_n_most_likely_samples(cluster) -> None:
    started, _ = cluster
    prompt = make_prompts((19,), seed=43)[0]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=2, best_of=5, logprobs=0)
    with Client(started.router_address) as client:
        parts = list(client.generate(prompt, params, timeout=120))
        everything = list(
            client.generate(prompt, dataclasses.replace(params, n=5, best_of=None), timeout=120)
        )
    assert [p.index for p in parts] == [0, 1]
    sums = [sum(lp.sampled.logprob for lp in p.logprobs) for p in parts]
    assert sums[0] >= sums[1]
    # the same seed draws the same five samples: best_of keeps the two most likely of them
    all_sums = sorted(
        (
            sum(lp.sampled.logprob for p in ps for lp in p.logprobs)
            for ps in by_index(everything).values()
        ),
        reverse=True,
    )
    assert sums == pytest.approx(all_sums[:2], abs=1e-4)
    assert parts[-1].usage.completion_tokens == everything[-1].usage.completion_tokens


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n": 3, "best_of": 2}, "sampling.best_of"),
        ({"n": 7}, "sampling.n"),
        ({"n": 2, "best_of": 9}, "sampling.best_of"),
        ({"n": 0}, "sampling.n"),
    ],
)
def test_bad_sample_counts_are_invalid_argument_naming_the_field(cluster, overrides, field) -> None:
    started, _ = cluster
    with Client(started.router_address) as client, pytest.raises(grpc.RpcError) as err:
        list(client.generate([5, 6, 7], dataclasses.replace(GREEDY, **overrides), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == field


def test_cancel_mid_stream_frees_every_sample(cluster) -> None:
    started, _ = cluster
    prompt = make_prompts((40,), seed=44)[0]
    params = SamplingParams(temperature=1.0, max_tokens=400, n=4, ignore_eos=True)
    with Client(started.router_address) as client:
        stream = client.generate(prompt, params, timeout=120)
        seen = 0
        for part in stream:
            seen += len(part.token_ids)
            if seen >= 12:
                break
        stream.cancel()
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 10), (
            "condition not met in time"
        )


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_through_the_cluster_equals_transformers(cluster, k: int) -> None:
    started, model_dir = cluster
    prompt = make_prompts((23,), seed=45 + k)[0]
    # NOTE: temperature left unset: a beam search's is 0, not the model's default
    sampling = common_pb2.SamplingParams(max_tokens=16, use_beam_search=True, beam_width=k, n=2)
    request = generation_pb2.GenerateRequest(sampling=sampling, stream=True)
    request.token_ids.ids.extend(prompt)
    with Client(started.router_address) as client:
        parts = list(client.stub.Generate(request, timeout=120))
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 5.0), (
            "condition not met in time"
        )
    want = hf_beams(model_dir, prompt, k, 16, 1.0, 2)
    samples = by_index(parts)
    assert sorted(samples) == [0, 1]
    assert [tokens_of(samples[i]) for i in (0, 1)] == want
    assert parts[-1].usage.completion_tokens == sum(len(w) for w in want)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"temperature": 0.7}, "sampling.temperature"),
        ({"n": 3, "beam_width": 2}, "sampling.n"),
        ({"best_of": 3}, "sampling.best_of"),
        ({"stop": ("x",)}, "sampling.stop"),
    ],
)
def test_bad_beam_searches_are_invalid_argument(cluster, overrides, field) -> None:
    started, _ = cluster
    params = dataclasses.replace(
        SamplingParams(temperature=0.0, max_tokens=8, use_beam_search=True, beam_width=2),
        **overrides,
    )
    with Client(started.router_address) as client, pytest.raises(grpc.RpcError) as err:
        list(client.generate([5, 6, 7], params, timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    bad = error_details_pb2.BadRequest()
    assert status is not None and status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == field


def test_a_stop_string_ends_each_sample(cluster) -> None:
    started, model_dir = cluster
    prompt = make_prompts((20,), seed=33)[0]
    want, _ = hf_greedy(model_dir, torch.float32, tuple(prompt))
    full_text = RouterTokenizer.from_model_dir(model_dir).decode(want[:24])
    stop = full_text[5:8]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, stop=(stop,), n=2)
    with Client(started.router_address) as client:
        parts = list(client.generate(prompt, params, timeout=60))
        # NOTE: every sample ended here: the router cancels the decode call, blocks are freed
        assert wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 5), (
            "condition not met in time"
        )
    for index, mine in by_index(parts).items():
        assert "".join(p.text for p in mine) == full_text[: full_text.index(stop)], index
        assert mine[-1].stop_string == stop
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_STOP
