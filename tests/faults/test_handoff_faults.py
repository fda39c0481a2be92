"""Faults in the prefill → decode handoff, against real worker processes.

    client ─► router (in process) ─► prefill process (real port)
                                 └─► decode process ── PullKv / ReleaseKv ─► FaultProxy ─► prefill

The prefill worker advertises the proxy as its address (`--advertise-address`) and offers no
shm (`--no-shm`), so every KV pull crosses the proxy while the router reaches the prefill worker
directly. Delaying only the proxy's upstream → client direction holds the KV bytes back for a
fixed time: the decode worker sits in its import, the window these tests need, while what it
sends to the prefill worker (ReleaseKv) still arrives at once.
"""

from __future__ import annotations

import argparse
import time

import grpc
import pytest
import torch
from proxy import PASS, FaultProxy, delay
from support.in_process_router import serve_router
from support.oracle import hf_greedy, make_prompts
from support.ports import free_port
from support.waits import wait_until
from support.workers import start, wait_ready

from pagedserve.internal.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
)
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)  # = oracle.NEW_TOKENS
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("handoff-logs")
    common = ["--model", str(tiny_llama), "--block-size", "16", "--drain-timeout", "1"]
    port = free_port()
    with FaultProxy(("127.0.0.1", port), max_life_s=300) as proxy:
        prefill = start(
            "prefill",
            [*common, "--port", str(port), "--advertise-address", proxy.address, "--no-shm",
             "--num-gpu-blocks-override", "256", "--worker-id", "prefill-h"],
            logs / "prefill.log",
            metrics_port=free_port(),
        )  # fmt: skip
        # NOTE: one import thread: a second import waits in the queue behind the first
        decode = start(
            "decode",
            [*common, "--num-gpu-blocks-override", "256", "--swap-space", "0.01",
             "--import-threads", "1", "--worker-id", "decode-h"],
            logs / "decode.log",
        )  # fmt: skip
        try:
            wait_ready(prefill)
            wait_ready(decode)
            prefill.address = f"127.0.0.1:{port}"  # NOTE: its READY line names the proxy
            yield prefill, decode, proxy, f"127.0.0.1:{port}"
        finally:
            decode.stop()
            prefill.stop()


@pytest.fixture(scope="module")
def router(workers, tiny_llama):
    """An in-process router (to read its state) reaching the prefill worker directly."""
    _, decode, _, prefill_address = workers
    args = argparse.Namespace(
        model=str(tiny_llama), served_model_name=None, revision="", dtype=None, block_size=16,
        redis_url=None, prefill=[prefill_address], decode=[decode.address],
        max_queued_requests=64, max_message_bytes=16 << 20,
    )  # fmt: skip
    with serve_router(args) as router:
        yield router.servicer, router.stub


def generate_request(prompt, params, request_id="") -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling_to_proto(params), stream=True
    )
    msg.token_ids.ids.extend(prompt)
    return msg


def decode_load(decode) -> common_pb2.LoadReport:
    with grpc.insecure_channel(decode.address) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        return stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def lease_counts(prefill) -> tuple[float, float, float]:
    """(released, expired, active) leases of the prefill worker, from its /metrics."""
    return (
        prefill.metric("kv_leases_released_total"),
        prefill.metric("kv_leases_expired_total"),
        prefill.metric("kv_leases_active"),
    )


def assert_serves(stub, prompt, model_dir) -> None:
    parts = list(stub.Generate(generate_request(prompt, GREEDY), timeout=60))
    tokens = [t for p in parts for t in p.token_ids]
    assert tokens == hf_greedy(model_dir, torch.float32, tuple(prompt))[0]


def test_cancel_during_the_handoff_releases_the_lease_and_frees_both_pools(
    workers, router, tiny_llama
):
    prefill, decode, proxy, _ = workers
    servicer, stub = router
    prompt, again = make_prompts((70, 33), seed=101)
    # NOTE: a first request opens the decode worker's channel to the prefill worker; a channel
    # opened under the delay would hold every call (ReleaseKv too) until the server's SETTINGS
    assert_serves(stub, again, tiny_llama)
    assert wait_until(lambda: prefill.used_blocks() == 0 and decode.used_blocks() == 0)
    released, expired, _ = lease_counts(prefill)
    proxy.set_mode(delay(2000, "down"))  # the KV bytes reach the decode worker 2 s late
    try:
        stream = stub.Generate(generate_request(prompt, LONG, "handoff"), timeout=60)
        first = next(stream)  # the prefill worker's token: the router now calls Decode
        assert first.token_ids
        # the window: the router passed the handle on, the decode worker is importing the KV;
        # until the worker answers, the router also keeps the handle (and releases it if the
        # call ends first: a release by both is harmless, the lease ends once)
        assert wait_until(lambda: decode_load(decode).num_requests_waiting == 1, timeout_s=5)
        (active,) = servicer.orchestrator.active.values()
        assert active.handle is not None, "the router keeps the handle until Decode answers"
        # NOTE: the worker may see the call a moment before the router registers its cancel
        # (an Abort in between still cancels it: `ActiveRequest.set_call` checks `aborted`)
        in_flight = wait_until(lambda: active.cancel_current is not None, timeout_s=5)
        assert in_flight, "the Decode call must be in flight"
        assert decode_load(decode).num_requests_running == 0
        assert prefill.used_blocks() > 0 and lease_counts(prefill)[2] == 1  # the lease holds
        stream.cancel()
        cancelled_at = time.monotonic()
        both_free = wait_until(
            lambda: prefill.used_blocks() == 0 and decode.used_blocks() == 0, timeout_s=1.0
        )
        freed_in_s = time.monotonic() - cancelled_at
        assert both_free, (prefill.used_blocks(), decode.used_blocks())
        now_released, now_expired, now_active = lease_counts(prefill)
        assert (now_released, now_expired, now_active) == (released + 1, expired, 0)
    finally:
        proxy.set_mode(PASS)
    with grpc.insecure_channel(decode.address) as channel:
        abort = decode_pb2_grpc.DecodeWorkerStub(channel).Abort
        assert not abort(common_pb2.AbortRequest(request_id="handoff"), timeout=5).found
    assert_serves(stub, again, tiny_llama)
    assert wait_until(lambda: prefill.used_blocks() == 0 and decode.used_blocks() == 0)
    print(f"both pools at baseline {freed_in_s * 1000:.0f} ms after the cancel")


def test_lease_expired_while_queued_for_import_is_recomputed_to_the_same_tokens(
    workers, tiny_llama
):
    """Request A imports slowly (its KV bytes come 1.2 s late); B, with a 1 s lease, waits
    behind it in the decode worker's import queue (one import thread) until its lease is gone.
    B must recompute its prompt and give transformers' tokens, never read the expired blocks."""
    prefill, decode, proxy, prefill_address = workers
    prompts = make_prompts((70, 45), seed=102)
    released, expired, _ = lease_counts(prefill)
    prefill_channel = grpc.insecure_channel(prefill_address)
    decode_channel = grpc.insecure_channel(decode.address)
    prefill_stub = prefill_pb2_grpc.PrefillWorkerStub(prefill_channel)
    decode_stub = decode_pb2_grpc.DecodeWorkerStub(decode_channel)
    proxy.set_mode(delay(1200, "down"))
    try:
        streams, firsts = [], []
        for i, (prompt, lease_s) in enumerate(zip(prompts, (30, 1), strict=True)):
            request = worker_pb2.WorkerRequest(
                request_id=f"queued-{i}", prompt_token_ids=prompt,
                sampling=sampling_to_proto(GREEDY),
            )  # fmt: skip
            prefilled = prefill_stub.Prefill(
                prefill_pb2.PrefillRequest(request=request, lease_seconds=lease_s), timeout=30
            )
            decode_request = decode_pb2.DecodeRequest(
                request=request, first_token=prefilled.first_token, kv_handle=prefilled.kv_handle
            )
            firsts.append(prefilled.first_token)
            streams.append(decode_stub.Decode(decode_request, timeout=60))
        # NOTE: both importing or queued for it (each Decode call submits on the server's
        # executor: the second may land a moment after this poll's first look)
        assert wait_until(lambda: decode_load(decode).num_requests_waiting == 2, timeout_s=1.0)
        results = [list(s) for s in streams]
    finally:
        proxy.set_mode(PASS)
        prefill_channel.close()
        decode_channel.close()
    for prompt, first, responses in zip(prompts, firsts, results, strict=True):
        tokens = [first] + [t for r in responses for t in r.token_ids]
        assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]
    a, b = results
    assert not a[-1].recomputed_prompt, "A held its lease to the end: its KV is imported"
    assert b[-1].recomputed_prompt, "B's lease expired in the queue: it must be recomputed"
    assert lease_counts(prefill) == (released + 1, expired + 1, 0)
    assert wait_until(lambda: prefill.used_blocks() == 0 and decode.used_blocks() == 0)
