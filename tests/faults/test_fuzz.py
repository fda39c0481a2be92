"""Protobuf fuzzing of the public API: hypothesis-made GenerateRequests and random bytes against
a real router server (no workers, so every well-formed request ends UNAVAILABLE at routing).
Nothing malformed may come back INTERNAL, and the server must keep answering.

Each fuzzer runs for a time budget (`FUZZ_SECONDS`, 30 s each: 60 s in all), in batches of
`BATCH` examples with seeds 0, 1, 2, ...: deterministic, bounded, and a failure names its seed."""

from __future__ import annotations

import argparse
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from support.in_process_router import serve_router

from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SERVICE = "pagedserve.v1.Generation"
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE}
U32 = st.integers(0, 2**32 - 1)
F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
FUZZ_SECONDS = 30.0
BATCH = 100
FUZZ = settings(
    max_examples=BATCH,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def router(make_tiny):
    args = argparse.Namespace(
        model=str(make_tiny("llama")), served_model_name=None, revision="", dtype=None,
        block_size=16, redis_url=None, prefill=[], decode=[], max_queued_requests=64,
        max_message_bytes=1 << 20, route_wait_timeout=0.0,  # no worker will come: answer now
    )  # fmt: skip
    with serve_router(args, max_message_bytes=1 << 20) as router:
        yield router.channel


sampling = st.builds(
    common_pb2.SamplingParams,
    temperature=F32, top_p=F32, top_k=U32, min_p=F32, seed=st.integers(0, 2**64 - 1),
    max_tokens=U32, min_tokens=U32, stop=st.lists(st.text(max_size=20), max_size=5),
    stop_token_ids=st.lists(U32, max_size=5), ignore_eos=st.booleans(),
    repetition_penalty=F32, presence_penalty=F32, frequency_penalty=F32, logprobs=U32,
    skip_special_tokens=st.booleans(),
)  # fmt: skip


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(
        request_id=draw(st.text(max_size=140)),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        cache_salt=draw(st.text(max_size=300)),
        stream=draw(st.booleans()),
    )
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling))
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        msg.text = draw(st.text(max_size=200))
    elif prompt == "ids":
        msg.token_ids.ids.extend(draw(st.lists(U32, max_size=80)))
    if draw(st.booleans()):
        msg.add_special_tokens = draw(st.booleans())
    return msg


def status_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def fuzz_for(seconds: float, batch) -> int:
    """Run `batch` (a hypothesis test) with seeds 0, 1, 2, ... until `seconds` have passed;
    returns the number of examples run."""
    deadline = time.monotonic() + seconds
    batches = 0
    while time.monotonic() < deadline:
        seed(batches)(batch)()
        batches += 1
    return batches * BATCH


def test_random_requests_are_never_internal(router):
    stub = generation_pb2_grpc.GenerationStub(router)

    @FUZZ
    @given(msg=generate_requests())
    def batch(msg):
        code = status_of(lambda: list(stub.Generate(msg, timeout=10)))
        assert code in ALLOWED, (code, msg)

    print(f"{fuzz_for(FUZZ_SECONDS, batch)} requests in {FUZZ_SECONDS:.0f} s")


def test_random_bytes_are_never_internal(router):
    @FUZZ
    @given(data=st.binary(max_size=512), method=st.sampled_from(["Generate", "Tokenize", "Abort"]))
    def batch(data, method):
        path = f"/{SERVICE}/{method}"
        if method == "Generate":
            call = router.unary_stream(path)
            code = status_of(lambda: list(call(data, timeout=10)))
        else:
            code = status_of(lambda: router.unary_unary(path)(data, timeout=10))
        assert code in ALLOWED | {grpc.StatusCode.OK}, (code, data)

    print(f"{fuzz_for(FUZZ_SECONDS, batch)} messages in {FUZZ_SECONDS:.0f} s")


def test_the_router_still_answers_after_the_fuzzing(router):
    stub = generation_pb2_grpc.GenerationStub(router)
    started = time.monotonic()
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
    assert info.block_size == 16 and time.monotonic() - started < 5
