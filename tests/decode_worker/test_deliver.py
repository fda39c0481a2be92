"""`DecodeWorker.Deliver`: the responses of many Decode calls on one stream, a step's in one
`DecodeBatch` (decode_worker/delivery.py). A real decode worker process; the test plays the
router: it opens a Deliver stream and names it in Decode calls that prefill on the worker."""

from __future__ import annotations

import threading
import uuid

import grpc
import pytest
import torch
from support.oracle import NEW_TOKENS, hf_greedy, make_prompts
from support.waits import wait_until
from support.workers import start, wait_ready

from pagedserve.internal.v1 import decode_pb2, decode_pb2_grpc, worker_pb2
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def decode(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("deliver") / "decode.log"
    args = ["--model", str(tiny_llama), "--block-size", "16", "--num-gpu-blocks-override", "512"]
    worker = wait_ready(start("decode", args, log))
    channel = grpc.insecure_channel(worker.address)
    try:
        yield decode_pb2_grpc.DecodeWorkerStub(channel), worker
    finally:
        channel.close()
        worker.kill()


class Delivery:
    """A Deliver stream read on a thread: every batch, and each request's responses."""

    def __init__(self, stub, delivery_id: str | None = None) -> None:
        self.id = delivery_id or uuid.uuid4().hex
        self.call = stub.Deliver(decode_pb2.DeliverRequest(delivery_id=self.id))
        self.batches: list[decode_pb2.DecodeBatch] = []
        self.error: grpc.RpcError | None = None
        assert list(next(self.call).responses) == []  # NOTE: the first batch: it is open
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.append(batch)
        except grpc.RpcError as err:
            self.error = err

    def responses(self, request_id: str) -> list[decode_pb2.DecodeResponse]:
        return [r for b in list(self.batches) for r in b.responses if r.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for r in self.responses(request_id) for t in r.token_ids]

    def finished(self, request_id: str) -> bool:
        return any(r.finish_reason for r in self.responses(request_id))


def decode_request(request_id: str, prompt: list[int], delivery_id: str, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = worker_pb2.WorkerRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
    )
    return decode_pb2.DecodeRequest(request=request, prefill_here=True, delivery_id=delivery_id)


def used_blocks(stub) -> int:
    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return load.kv_blocks_total - load.kv_blocks_free - load.kv_blocks_cached


def test_requests_on_one_stream_equal_transformers_a_step_to_a_message(decode, tiny_llama):
    stub, _ = decode
    delivery = Delivery(stub)
    prompts = make_prompts((5, 17, 33, 64, 90, 128, 7, 40), seed=91)
    ended: dict[str, list] = {}

    def run(i: int) -> None:
        call = stub.Decode(decode_request(f"r{i}", prompts[i], delivery.id, NEW_TOKENS),
                           timeout=TIMEOUT_S)  # fmt: skip
        ended[f"r{i}"] = list(call)  # NOTE: a delivered Decode call sends nothing, then ends OK
        ended[f"r{i}"].append(delivery.finished(f"r{i}"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    for i, prompt in enumerate(prompts):
        want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
        assert delivery.tokens(f"r{i}") == want, i
        # NOTE: the call ended after its last response was sent, so it has been read, or is
        # about to be: it cannot be missing for good
        assert ended[f"r{i}"][:-1] == []
        assert wait_until(lambda i=i: delivery.finished(f"r{i}"), 5.0)
    # the steps' responses for all eight requests travelled together
    assert max(len(b.responses) for b in delivery.batches) >= len(prompts)
    assert wait_until(lambda: used_blocks(stub) == 0, 10.0)
    delivery.call.cancel()


def test_a_cancelled_call_frees_its_request_and_the_others_on_the_stream_go_on(decode, tiny_llama):
    stub, _ = decode
    delivery = Delivery(stub)
    prompts = make_prompts((20, 30), seed=92)
    doomed = stub.Decode(decode_request("doomed", prompts[0], delivery.id, 2000),
                         timeout=TIMEOUT_S)  # fmt: skip
    assert wait_until(lambda: len(delivery.tokens("doomed")) >= 3, 30.0)
    doomed.cancel()
    survivor = stub.Decode(decode_request("survivor", prompts[1], delivery.id, NEW_TOKENS),
                           timeout=TIMEOUT_S)  # fmt: skip
    assert list(survivor) == []
    want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompts[1]))
    assert delivery.tokens("survivor") == want
    assert not delivery.finished("doomed")
    assert wait_until(lambda: used_blocks(stub) == 0, 10.0)
    delivery.call.cancel()


def test_a_stream_that_ends_fails_its_requests_unavailable_and_frees_them(decode):
    stub, _ = decode
    delivery = Delivery(stub)
    calls = [
        stub.Decode(decode_request(f"long{i}", p, delivery.id, 2000), timeout=TIMEOUT_S)
        for i, p in enumerate(make_prompts((24, 48, 12), seed=93))
    ]
    assert wait_until(lambda: all(delivery.tokens(f"long{i}") for i in range(3)), 30.0)
    delivery.call.cancel()  # NOTE: as when the router's connection goes
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert wait_until(lambda: used_blocks(stub) == 0, 10.0)


def test_unknown_empty_and_duplicate_delivery_ids_are_refused(decode):
    stub, _ = decode
    call = stub.Decode(decode_request("nowhere", [5, 6, 7], "no-such-stream", 4), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "no-such-stream" in err.value.details()
    for bad in ("", "x" * 129):
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Deliver(decode_pb2.DeliverRequest(delivery_id=bad), timeout=10))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "delivery_id" in err.value.details()
    first = Delivery(stub)
    with pytest.raises(grpc.RpcError) as err:
        next(stub.Deliver(decode_pb2.DeliverRequest(delivery_id=first.id), timeout=10))
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
    first.call.cancel()
    assert used_blocks(stub) == 0


def test_a_backlog_goes_in_batches_below_the_cap_in_order(monkeypatch):
    from pagedserve.decode_worker import delivery

    monkeypatch.setattr(delivery, "MAX_BATCH_BYTES", 100)
    responses = [
        decode_pb2.DecodeResponse(request_id=f"r{i}", token_ids=[7] * n)
        for i, n in enumerate((10, 10, 10, 200, 10, 30, 30, 30))
    ]
    batches = delivery._split(responses)
    assert [r.request_id for b in batches for r in b.responses] == [f"r{i}" for i in range(8)]
    for batch in batches:  # NOTE: 16, 16, 16 | 207 (alone) | 16, 36, 36 | 36 bytes
        assert sum(r.ByteSize() for r in batch.responses) <= 100 or len(batch.responses) == 1
    assert [len(b.responses) for b in batches] == [3, 1, 3, 1]
