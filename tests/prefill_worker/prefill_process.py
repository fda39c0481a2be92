"""A real `pagedserve prefill` process for tests, and small gRPC helpers to drive it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedserve.internal.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.kvstore.transfer import BlockAssembler, BlockChunk, ShmBlockReader, ShmOffer
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

BLOCK_SIZE = 16
MODEL_NAME = "tiny"


@dataclass
class WorkerProcess:
    """A running `pagedserve prefill` and a stub to it; `close()` kills it (idempotent)."""

    proc: subprocess.Popen[str]
    stub: prefill_pb2_grpc.PrefillWorkerStub
    channel: grpc.Channel
    worker_id: str
    address: str
    log_path: Path

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_worker(
    model: Path, redis_url: str | None, workdir: Path, worker_id: str, *extra: str
) -> WorkerProcess:
    """Start a worker on a free port and wait for its READY line (bounded by pytest's timeout)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{worker_id}.log"
    args = [sys.executable, "-m", "pagedserve.cli", "prefill", "--model", str(model)]
    args += ["--port", "0", "--served-model-name", MODEL_NAME, "--block-size", str(BLOCK_SIZE)]
    args += ["--worker-id", worker_id, "--drain-timeout", "2"]
    args += ["--redis-url", redis_url] if redis_url else []
    with log_path.open("w") as log:
        proc = subprocess.Popen([*args, *extra], stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until READY or exit
    if not line.startswith("READY"):
        proc.kill()
        proc.wait(10)
        pytest.fail(f"worker did not start: {log_path.read_text()[-2000:]}")
    _, ready_id, address = line.split()
    channel = grpc.insecure_channel(address)
    stub = prefill_pb2_grpc.PrefillWorkerStub(channel)
    return WorkerProcess(proc, stub, channel, ready_id, address, log_path)


def prefill(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    request_id: str,
    prompt: list[int],
    *,
    lease_seconds: int = 0,
    cache_salt: str = "",
    **sampling: object,
) -> prefill_pb2.PrefillResponse:
    """One greedy Prefill over gRPC (max_tokens 8 unless given)."""
    params = SamplingParams(**({"temperature": 0.0, "max_tokens": 8} | sampling))  # type: ignore[arg-type]
    request = worker_pb2.WorkerRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling_to_proto(params),
        cache_salt=cache_salt,
    )
    message = prefill_pb2.PrefillRequest(request=request, lease_seconds=lease_seconds)
    return stub.Prefill(message, timeout=60)


def load(stub: prefill_pb2_grpc.PrefillWorkerStub) -> common_pb2.LoadReport:
    return stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def used_blocks(stub: prefill_pb2_grpc.PrefillWorkerStub) -> int:
    report = load(stub)
    return report.kv_blocks_total - report.kv_blocks_free - report.kv_blocks_cached


def pull_request(
    handle: worker_pb2.KvHandle, indices: list[int] | None = None, max_chunk_bytes: int = 5000
) -> prefill_pb2.PullKvRequest:
    return prefill_pb2.PullKvRequest(
        handle_id=handle.handle_id,
        producer_incarnation=handle.producer_incarnation,
        block_indices=indices or [],
        max_chunk_bytes=max_chunk_bytes,
    )


def pull_over_grpc(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    handle: worker_pb2.KvHandle,
    cache: KVCache,
    dst_ids: dict[int, int],
) -> None:
    """PullKv the handle's blocks `dst_ids.keys()` (indices) into `cache` blocks `dst_ids[i]`."""
    assembler = BlockAssembler(cache, dst_ids)
    for c in stub.PullKv(pull_request(handle, sorted(dst_ids)), timeout=30):
        assembler.feed(BlockChunk(c.block_index, c.block_id, c.offset, c.data, c.last_of_block))
    assert assembler.complete


def read_over_shm(handle: worker_pb2.KvHandle, cache: KVCache, dst_ids: dict[int, int]) -> None:
    """Copy the handle's blocks `dst_ids.keys()` out of the producer's segment into `cache`."""
    shm = handle.shm
    offer = ShmOffer(
        shm.segment_name, shm.host_id, shm.pool_offset_bytes, shm.num_blocks,
        shm.block_stride_bytes, shm.layer_stride_bytes, shm.kv_stride_bytes,
    )  # fmt: skip
    reader = ShmBlockReader(offer, cache.spec)
    try:
        indices = sorted(dst_ids)
        src = [handle.block_ids[i] for i in indices]
        reader.read_blocks(src, cache, [dst_ids[i] for i in indices])
    finally:
        reader.close()
