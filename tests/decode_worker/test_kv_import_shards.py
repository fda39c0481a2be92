"""A tensor-parallel hand-off pulls its ranks' shards at the same time (kv_import `_pull`), on a
real TP-2 decode engine (rank processes): each rank's shard once, a KV head replicated on two
ranks once and copied, a failed shard failing the pull only after every shard has stopped, and an
abort cancelling every shard's stream. The transports themselves (shm, gRPC by rank) are tested
through worker processes in test_tp_handoff.py and tests/router/test_tp_cluster_e2e.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.kv_import import ImportCancel, KvImporter, ProducerClients
from pagedserve.kvstore.transfer import TransferError

WAIT_S = 30.0


@pytest.fixture(params=[2, 1], ids=["2-kv-heads", "1-kv-head"])
def importer(request, make_tiny):
    model_dir = make_tiny("llama", heads=4, kv_heads=request.param, layers=2)
    config = DecodeEngineConfig(
        block_size=4, num_blocks=32, num_swap_blocks=0, tensor_parallel_size=2
    )
    engine = DecodeEngine.from_model_dir(str(model_dir), config)
    importer = KvImporter(engine, threading.RLock(), ProducerClients())
    try:
        yield importer
    finally:
        importer.close()
        engine.close()


def fill_shard(importer: KvImporter, rank: int, blocks: dict[int, int], value: float) -> None:
    caches = importer.engine.runner.kv_caches
    assert caches is not None
    caches[rank].tensor[torch.tensor(sorted(blocks.values()))] = value


def test_shards_are_pulled_at_once_and_a_replicated_head_once(importer, monkeypatch):
    size = importer.engine.config.tensor_parallel_size
    sources = importer._shard_sources()
    both_split = len(sources) == size  # 2 KV heads: one each; 1 KV head: rank 1 replicates
    in_flight = threading.Barrier(len(sources), timeout=WAIT_S)
    pulled: list[tuple[int, str]] = []

    def pull_shard(handle, blocks, rank, cache):
        in_flight.wait()  # NOTE: breaks (BrokenBarrierError) if the shards ran one by one
        pulled.append((rank, threading.current_thread().name))
        fill_shard(importer, rank, blocks, float(rank + 1))
        return "shm"

    monkeypatch.setattr(importer, "_pull_shard", pull_shard)
    blocks = {0: 3, 1: 5, 2: 7}
    assert importer._pull(None, blocks) == "shm"  # type: ignore[arg-type]
    caches = importer.engine.runner.kv_caches
    assert caches is not None
    ids = torch.tensor([3, 5, 7])
    if both_split:
        assert sorted(rank for rank, _ in pulled) == [0, 1]
        assert {name.startswith("kv-shard") for _, name in pulled} == {False, True}
        assert torch.all(caches[1].tensor[ids] == 2.0)
    else:
        assert [rank for rank, _ in pulled] == [0]  # the replicated head travelled once
        assert torch.all(caches[1].tensor[ids] == 1.0)  # and was copied to its replica
    assert torch.all(caches[0].tensor[ids] == 1.0)


@pytest.mark.parametrize("importer", [2], ids=["2-kv-heads"], indirect=True)
def test_a_failed_shard_fails_the_pull_after_every_shard_stopped(importer, monkeypatch):
    other_stopped = threading.Event()

    def pull_shard(handle, blocks, rank, cache):
        if rank == 0:  # the import thread's own shard fails at once
            raise TransferError("rank 0's producer went away")
        time.sleep(0.3)  # the other shard is still copying meanwhile
        other_stopped.set()
        return "grpc"

    monkeypatch.setattr(importer, "_pull_shard", pull_shard)
    with pytest.raises(TransferError, match="rank 0"):
        importer._pull(None, {0: 1})  # type: ignore[arg-type]
    assert other_stopped.is_set(), "failed while a shard could still write our blocks"


class Call:
    """Stands in for a gRPC stream (grpc's object, not ours): records `cancel()`."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_an_abort_cancels_every_shard_stream():
    cancel = ImportCancel()
    calls = [Call(), Call()]
    for call in calls:
        cancel.attach(call)  # type: ignore[arg-type]
    cancel.cancel()
    assert all(call.cancelled for call in calls)
    late = Call()
    cancel.attach(late)  # type: ignore[arg-type]
    assert late.cancelled
