"""An exception in one request's sampling fails that request only (in-process DecodeWorker on
the tiny model; outputs checked against transformers)."""

from __future__ import annotations

import threading

import pytest
import torch
from support.oracle import hf_greedy, make_prompts

from pagedserve.decode_worker.convert import DecodeCall
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.model.requests.sequence import FinishReason
from pagedserve.model.sampler import Sampler
from pagedserve.sampling_params import SamplingParams

POISON = 13  # a prompt starting with this token makes the sampler raise
MAX_TOKENS = 12


def call(request_id: str, prompt: list[int], first_token: int) -> DecodeCall:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return DecodeCall(request_id, prompt, params, 0, "", first_token, None, None)


def drain(stream, timeout_s: float = 60.0):
    tokens, delta = [], None
    while delta is None or delta.finish_reason is None:
        delta = stream.get(timeout_s)
        assert delta is not None, "stream stalled"
        tokens += delta.token_ids
    return tokens, delta


@pytest.fixture
def worker(tiny_llama):
    config = DecodeEngineConfig(block_size=16, num_blocks=64, num_swap_blocks=0)
    worker = DecodeWorker(DecodeEngine.from_model_dir(str(tiny_llama), config))
    yield worker
    worker.close()
    worker.engine.check_integrity()
    assert worker.engine.pool.num_used == 0


def test_a_request_whose_sampling_raises_fails_alone(worker, tiny_llama, monkeypatch):
    original = Sampler.__call__
    raised = threading.Event()

    def sampler(self, logits, rows):
        if any(
            row.prompt_token_ids[0] == POISON and len(row.output_token_ids) >= 3 for row in rows
        ):
            raised.set()
            raise RuntimeError("injected sampling fault")
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", sampler)
    prompts = make_prompts((9, 17, 30, 5), seed=81)
    prompts[2][0] = POISON
    wants = [hf_greedy(tiny_llama, torch.float32, tuple(p))[0][:MAX_TOKENS] for p in prompts]
    streams = [
        worker.submit(call(f"r{i}", p, w[0]))
        for i, (p, w) in enumerate(zip(prompts, wants, strict=True))
    ]  # noqa: E501
    worker.start()
    results = [drain(s) for s in streams]
    assert raised.is_set()
    for i, (tokens, last) in enumerate(results):
        if i == 2:
            assert last.finish_reason is FinishReason.ERROR
            assert "r2" in (last.error or "")
        else:
            assert last.finish_reason is FinishReason.LENGTH, (i, last.error)
            assert [wants[i][0], *tokens] == wants[i]
    assert not worker.dead and not worker.load().draining
    again = worker.submit(call("after", prompts[0], wants[0][0]))  # the engine still serves
    assert [wants[0][0], *drain(again)[0]] == wants[0]


def test_a_dead_loop_flips_health_and_fails_every_request(worker, tiny_llama, monkeypatch):
    flipped = threading.Event()
    worker.on_loop_death = lambda death: flipped.set()

    def explode(*_):
        raise SystemExit("the loop thread is gone")  # not an Exception: the loop cannot go on

    monkeypatch.setattr(worker, "step", explode)
    prompt = make_prompts((9,), seed=82)[0]
    stream = worker.submit(call("doomed", prompt, 1))
    worker.start()
    _, last = drain(stream)
    assert last.finish_reason is FinishReason.ERROR
    assert flipped.wait(5) and worker.dead and worker.load().draining
