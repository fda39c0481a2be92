"""KV hand-off between tensor-parallel workers as real processes, the test playing the router:
a TP-2 prefill worker offering only gRPC streams each rank's shard (`PullKvRequest.rank`) to a
TP-2 decode worker, whose greedy tokens equal transformers' with nothing recomputed, also when
its small KV pool makes it preempt (swap); a TP-1 producer's hand-off is
refused by the TP-2 decode worker (recomputed, same tokens, the reason naming the flag); a rank
the producer does not have is INVALID_ARGUMENT naming `rank`."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from support.oracle import hf_greedy, make_prompts
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

TIMEOUT_S = 60
MAX_TOKENS = 32  # = oracle.NEW_TOKENS


# NOTE: five processes (two workers of two ranks, one of one) importing torch at once on a
# loaded 2-core CI machine took more than the usual minute to say READY
START_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def workers(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-logs")
    common = ["--model", str(tiny_llama), "--block-size", "16", "--drain-timeout", "1"]
    prefill = [*common, "--num-gpu-blocks-override", "256"]
    # 12 blocks of 16 tokens per rank: one prompt at a time fits, six prompts of ~40 tokens and
    # 32 new ones (~30 blocks) do not: the decode worker preempts (swap; recompute is covered
    # in-process, tests/model/test_tensor_parallel.py)
    decode = [*common, "--num-gpu-blocks-override", "12", "-tp", "2", "--swap-space", "0.01",
              "--preemption-mode", "swap"]  # fmt: skip
    procs = {
        "prefill-tp2": start("prefill", [*prefill, "-tp", "2", "--no-shm"], logs / "p2.log"),
        "prefill-tp1": start("prefill", prefill, logs / "p1.log"),
        "decode": start("decode", decode, logs / "d.log"),
    }
    try:
        for proc in procs.values():
            wait_ready(proc, START_TIMEOUT_S)
        yield procs, {name: grpc.insecure_channel(p.address) for name, p in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()


def play_router(workers, producer: str, request_id: str, prompt: list[int]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    request = worker_pb2.WorkerRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
    )
    stub = prefill_pb2_grpc.PrefillWorkerStub(workers[1][producer])
    prefilled = stub.Prefill(prefill_pb2.PrefillRequest(request=request), timeout=TIMEOUT_S)
    decode = decode_pb2.DecodeRequest(
        request=request, first_token=prefilled.first_token, kv_handle=prefilled.kv_handle
    )
    responses = list(
        decode_pb2_grpc.DecodeWorkerStub(workers[1]["decode"]).Decode(decode, timeout=TIMEOUT_S)
    )
    tokens = [prefilled.first_token] + [t for r in responses for t in r.token_ids]
    preemptions = max(r.num_preemptions for r in responses)
    return prefilled.kv_handle, tokens, any(r.recomputed_prompt for r in responses), preemptions


def used_blocks(workers) -> int:
    stub = decode_pb2_grpc.DecodeWorkerStub(workers[1]["decode"])
    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return load.kv_blocks_total - load.kv_blocks_free - load.kv_blocks_cached


def test_two_ranks_hand_off_over_grpc_rank_by_rank(workers, tiny_llama):
    for i, prompt in enumerate(make_prompts((7, 33, 90), seed=41)):
        handle, tokens, recomputed, _ = play_router(workers, "prefill-tp2", f"tp2-{i}", prompt)
        assert handle.layout.tensor_parallel_size == 2 and len(handle.shards) == 2
        assert not handle.HasField("shm") and not handle.shards[1].HasField("shm")
        assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]
        assert not recomputed, "the hand-off must be used, not recomputed"
    assert wait_until(lambda: used_blocks(workers) == 0)


def test_two_ranks_under_kv_pressure_swap_and_keep_every_token(workers, tiny_llama):
    prompts = make_prompts((38, 41, 44, 36, 47, 40), seed=44)
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        results[i] = play_router(workers, "prefill-tp2", f"pressure-{i}", prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    assert len(results) == len(prompts)
    for i, prompt in enumerate(prompts):
        assert results[i][1] == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0], i
    assert max(r[3] for r in results.values()) > 0, "the pool cannot hold all six at once"


def test_a_one_rank_producer_is_refused_and_recomputed(workers, tiny_llama):
    [prompt] = make_prompts((40,), seed=42)
    handle, tokens, recomputed, _ = play_router(workers, "prefill-tp1", "tp1-0", prompt)
    assert handle.layout.tensor_parallel_size in (0, 1) and not handle.shards
    assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]
    assert recomputed
    log = workers[0]["decode"].log_path.read_text()
    assert "the producer has 1 tensor-parallel ranks, we have 2" in log
    assert "--tensor-parallel-size" in log


def test_pulling_a_rank_the_producer_does_not_have_names_the_field(workers):
    stub = prefill_pb2_grpc.PrefillWorkerStub(workers[1]["prefill-tp2"])
    [prompt] = make_prompts((20,), seed=43)
    request = worker_pb2.WorkerRequest(
        request_id="rank-oob", prompt_token_ids=prompt,
        sampling=sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=2)),
    )  # fmt: skip
    handle = stub.Prefill(
        prefill_pb2.PrefillRequest(request=request, lease_seconds=30), timeout=TIMEOUT_S
    ).kv_handle
    pull = prefill_pb2.PullKvRequest(
        handle_id=handle.handle_id, producer_incarnation=handle.producer_incarnation, rank=2
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.PullKv(pull, timeout=TIMEOUT_S))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("rank:")
    stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(handle_id=handle.handle_id), timeout=5)
