"""A burst of 1,000 streams at once through `pagedserve up` with its default limits (no limit
flag given): every one queues and completes, none is refused or dropped.

    500 gRPC streams (grpc.aio) ──────────────────────────┐
                                                          ├─► router ─► prefill ─► decode
    500 SSE streams (openai SDK) ─► gateway (one channel) ┘

What each layer would otherwise refuse (docs/router.md, "Overload"): the router's queue
(`--max-queued-requests`, 256 before it was sized by memory), gRPC core's pending calls (1000
soft, 3000 hard: a bare CANCELLED), the prefill worker's queue (1024).
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import openai
import pytest
from support.probes import blocks_in_use
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.protoconv import sampling_to_proto
from pagedserve.router.cli_args import DEFAULT_MAX_QUEUED_REQUESTS
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

NUM_GRPC = 500
NUM_HTTP = 500
MAX_TOKENS = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TIMEOUT_S = 240.0  # each stream's deadline: the burst takes 7-40 s on 2 busy cores


@pytest.fixture(scope="module")
def cluster(tiny_llama, clusters):
    """`pagedserve up` with its gateway and no limit flag: the defaults are under test."""
    return clusters.get(tiny_llama, http_port=0)


async def grpc_stream(stub: generation_pb2_grpc.GenerationStub, i: int) -> str:
    """`ok` when the stream ends with its MAX_TOKENS tokens, else what went wrong."""
    msg = generation_pb2.GenerateRequest(
        request_id=f"burst-{i}", text=f"burst {i}: the", sampling=sampling_to_proto(PARAMS),
        stream=True,
    )  # fmt: skip
    tokens, finish = 0, None
    try:
        async for part in stub.Generate(msg, timeout=TIMEOUT_S):
            tokens += len(part.token_ids)
            finish = part.finish_reason or finish
    except grpc.aio.AioRpcError as err:
        return f"grpc {err.code().name}: {err.details()}"
    if (tokens, finish) != (MAX_TOKENS, common_pb2.FINISH_REASON_LENGTH):
        return f"grpc {tokens} tokens, finish {finish}"
    return "ok"


async def http_stream(client: openai.AsyncOpenAI, model: str, i: int) -> str:
    try:
        stream = await client.completions.create(
            model=model, prompt=f"burst {i}: a", max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = [c.choices[0].finish_reason async for c in stream if c.choices]
    except openai.APIError as err:
        return f"http {type(err).__name__}: {err}"
    return "ok" if finish and finish[-1] == "length" else f"http finish {finish}"


async def burst(router: str, http_url: str, model: str) -> collections.Counter[str]:
    async with (
        grpc.aio.insecure_channel(router) as channel,
        openai.AsyncOpenAI(
            base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
        ) as client,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = [grpc_stream(stub, i) for i in range(NUM_GRPC)]
        streams += [http_stream(client, model, i) for i in range(NUM_HTTP)]
        return collections.Counter(await asyncio.gather(*streams))


def test_a_burst_of_1000_streams_through_up_defaults_queues_and_completes(cluster):
    assert NUM_GRPC + NUM_HTTP <= DEFAULT_MAX_QUEUED_REQUESTS
    router = next(c for c in cluster.children if c.name == "router")
    assert "--max-queued-requests" not in router.argv  # NOTE: the router's own default
    with Client(cluster.router_address) as client:
        model = client.model_info().model_name
        outcomes = asyncio.run(burst(cluster.router_address, cluster.http_url, model))
        assert outcomes == {"ok": NUM_GRPC + NUM_HTTP}, outcomes
        # every block back: free + cached == total on every worker (what check_integrity
        # proves in-process), and every worker still alive
        returned = wait_until(lambda: set(blocks_in_use(client).values()) == {0}, 10.0)
        assert returned, blocks_in_use(client)
        status = client.status()
        assert all(w.alive for w in status.workers), status
        assert all(w.load.num_requests_running == 0 for w in status.workers), status
