"""The prefill worker as a real process: `pagedserve prefill` with a real redis-server, driven
over gRPC on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from oracle import hf_greedy, make_prompts

from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.transfer import BlockAssembler, BlockChunk, ShmBlockReader, ShmOffer
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

BLOCK_SIZE = 16


@pytest.fixture
def worker(tiny_llama, redis_server, tmp_path):
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pagedserve.cli", "prefill", "--model", str(tiny_llama),
            "--port", "0", "--redis-url", redis_server.url, "--served-model-name", "tiny",
            "--num-gpu-blocks-override", "64", "--block-size", str(BLOCK_SIZE),
            "--worker-id", "prefill-a", "--drain-timeout", "2",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )  # fmt: skip
    line = proc.stdout.readline()  # blocks until READY or exit
    if not line.startswith("READY"):
        proc.kill()
        log.close()
        pytest.fail(f"worker did not start: {(tmp_path / 'worker.log').read_text()[-2000:]}")
    _, worker_id, address = line.split()
    channel = grpc.insecure_channel(address)
    yield proc, prefill_pb2_grpc.PrefillWorkerStub(channel), worker_id
    channel.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    log.close()


def prefill(stub, request_id, prompt, **sampling):
    params = SamplingParams(**({"temperature": 0.0, "max_tokens": 8} | sampling))
    request = common_pb2.WorkerRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
    )
    return stub.Prefill(prefill_pb2.PrefillRequest(request=request), timeout=60)


def test_prefill_hands_out_a_lease_readable_by_shm_and_grpc(worker, tiny_llama, redis_server):
    proc, stub, worker_id = worker
    (prompt,) = make_prompts((40,), seed=21)
    response = prefill(stub, "r1", prompt)
    want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
    assert response.first_token == want[0]
    handle = response.kv_handle
    assert (handle.num_tokens, len(handle.block_ids), len(handle.block_hashes)) == (40, 3, 2)
    assert handle.producer_id == worker_id and handle.lease_expires_unix_ms > time.time() * 1000

    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    by_shm = KVCache(spec, 3)
    shm = handle.shm
    reader = ShmBlockReader(
        ShmOffer(
            shm.segment_name, shm.host_id, shm.pool_offset_bytes, shm.num_blocks,
            shm.block_stride_bytes, shm.layer_stride_bytes, shm.kv_stride_bytes,
        ),
        spec,
    )  # fmt: skip
    reader.read_blocks(list(handle.block_ids), by_shm, [0, 1, 2])
    reader.close()

    by_grpc = KVCache(spec, 3)
    assembler = BlockAssembler(by_grpc, {0: 0, 1: 1, 2: 2})
    pull = prefill_pb2.PullKvRequest(
        handle_id=handle.handle_id,
        producer_incarnation=handle.producer_incarnation,
        max_chunk_bytes=5000,
    )
    for c in stub.PullKv(pull, timeout=30):
        assembler.feed(BlockChunk(c.block_index, c.block_id, c.offset, c.data, c.last_of_block))
    assert assembler.complete
    assert torch.equal(by_shm.tensor, by_grpc.tensor) and by_shm.tensor.abs().sum() > 0

    # the full blocks are in the Redis index under this worker
    index = RedisPrefixIndex(connect(redis_server.url), "tiny")
    assert index.lookup(list(handle.block_hashes)) == {worker_id: 2}
    registry = WorkerRegistry(connect(redis_server.url), "tiny")
    assert [w.worker_id for w in registry.live_workers(Role.PREFILL)] == [worker_id]

    renewed = stub.RenewLease(
        prefill_pb2.RenewLeaseRequest(handle_id=handle.handle_id, extend_seconds=60), timeout=5
    )
    assert renewed.lease_expires_unix_ms > handle.lease_expires_unix_ms
    release = prefill_pb2.ReleaseKvRequest(handle_id=handle.handle_id)
    assert stub.ReleaseKv(release, timeout=5).found
    assert not stub.ReleaseKv(release, timeout=5).found
    with pytest.raises(grpc.RpcError) as info:
        list(stub.PullKv(pull, timeout=5))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)
    assert (load.kv_blocks_total, load.kv_blocks_cached, load.kv_blocks_free) == (64, 2, 62)

    again = prefill(stub, "r2", prompt)
    assert again.cached_tokens == 32 and again.computed_tokens == 8
    assert again.first_token == response.first_token


def test_bad_request_is_invalid_argument_naming_the_field(worker):
    _, stub, _ = worker
    with pytest.raises(grpc.RpcError) as info:
        prefill(stub, "bad", [1, 2, 3], top_p=2.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    rpc_status.from_call(info.value).details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "top_p"
    with pytest.raises(grpc.RpcError) as info:
        prefill(stub, "", [1, 2, 3])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_drains_deregisters_and_removes_the_segment(worker, redis_server):
    proc, stub, worker_id = worker
    (prompt,) = make_prompts((20,), seed=22)
    segment = prefill(stub, "r", prompt).kv_handle.shm.segment_name
    assert os.path.exists(f"/dev/shm/{segment}")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert not os.path.exists(f"/dev/shm/{segment}")
    registry = WorkerRegistry(connect(redis_server.url), "tiny")
    assert registry.live_workers(Role.PREFILL) == []
