"""`stream_interval` in the decode worker (a real in-process `DecodeWorker` computing the prompt
itself, as `pagedserve up` does for short prompts): a delta is handed to the request's stream
only once the interval is full, so a throughput-bound client's reader is woken once per
interval, not once per step; the first token still goes alone, at once, and the last delta
carries what is left."""

from __future__ import annotations

import pytest
import torch
from support.oracle import hf_greedy, make_prompts
from support.waits import wait_until

from pagedserve.decode_worker import convert, streams
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.internal.v1 import decode_pb2, worker_pb2
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams

TIMEOUT_S = 60


class RecordingStream:
    """Every delta as the worker hands it over: nothing merged on the reader's side."""

    def __init__(self) -> None:
        self.deltas: list[streams.Delta] = []

    def put(self, delta: streams.Delta) -> None:
        self.deltas.append(delta)


def call(request_id: str, prompt: list[int], interval: int, **sampling) -> convert.DecodeCall:
    params = SamplingParams(
        **({"temperature": 0.0, "max_tokens": 24, "ignore_eos": True} | sampling)
    )
    request = worker_pb2.WorkerRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling_to_proto(params),
        stream_interval=interval,
    )
    return convert.decode_call(decode_pb2.DecodeRequest(request=request, prefill_here=True))


@pytest.fixture
def worker(tiny_llama):
    engine = DecodeEngine.from_model_dir(
        str(tiny_llama), DecodeEngineConfig(block_size=16, num_blocks=64, num_swap_blocks=0)
    )
    worker = DecodeWorker(engine)
    yield worker
    worker.close()
    engine.check_integrity()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize(
    ("interval", "sizes"),
    [(1, [1] * 24), (5, [1, 5, 5, 5, 5, 3]), (1 << 16, [1, 23])],
)
def test_a_delta_is_handed_over_only_when_its_interval_is_full(worker, tiny_llama, interval, sizes):
    prompt = make_prompts((30,), seed=81)[0]
    stream = RecordingStream()
    worker.submit(call("interval", prompt, interval), stream=stream)  # type: ignore[arg-type]
    worker.start()
    assert wait_until(
        lambda: stream.deltas and stream.deltas[-1].finish_reason is not None, TIMEOUT_S
    )
    want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
    assert [t for d in stream.deltas for t in d.token_ids] == want[:24]
    assert [len(d.token_ids) for d in stream.deltas] == sizes
