"""The decode worker as a real process, fed by real prefill worker processes: the test plays the
router (Prefill, then Decode with the handle) over gRPC on loopback, with a real redis-server.

Processes, started once for the module (in parallel): `prefill-shm` (offers shm and gRPC),
`prefill-grpc` (`--no-shm`), `decode`, and `prefill-doomed`, killed by the producer-gone test.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.oracle import hf_greedy, make_prompts
from support.waits import wait_until
from support.workers import start, wait_ready

from pagedserve.decode_worker import convert
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.worker import DecodeWorker
from pagedserve.internal.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
)
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect
from pagedserve.protoconv import sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2

BLOCK_SIZE = 16
MAX_TOKENS = 32  # = oracle.NEW_TOKENS
MIXED_LENS = (1, 7, 16, 17, 33, 64, 150, 300, 5, 12, 40, 90, 31, 48, 128, 200)
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def cluster(tiny_llama, module_redis, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", str(tiny_llama), "--block-size", str(BLOCK_SIZE)]
    prefill = [*common, "--num-gpu-blocks-override", "1024", "--drain-timeout", "1"]
    procs = {
        "prefill-shm": start("prefill", prefill, logs / "prefill-shm.log"),
        "prefill-grpc": start("prefill", [*prefill, "--no-shm"], logs / "prefill-grpc.log"),
        "prefill-doomed": start("prefill", prefill, logs / "prefill-doomed.log"),
        "decode": start(
            "decode",
            [
                *common, "--num-gpu-blocks-override", "1024", "--swap-space", "0.01",
                "--redis-url", module_redis.url, "--served-model-name", "tiny",
                # NOTE: a bound, not a speed check: 300 tokens under a loaded CI took > 10 s
                "--worker-id", "decode-a", "--drain-timeout", "60",
            ],
            logs / "decode.log",
        ),
    }  # fmt: skip
    try:
        for proc in procs.values():
            wait_ready(proc)
        channels = {name: grpc.insecure_channel(p.address) for name, p in procs.items()}
        yield procs, channels
    finally:
        for proc in procs.values():
            proc.kill()


def prefill_stub(cluster, name):
    return prefill_pb2_grpc.PrefillWorkerStub(cluster[1][name])


def decode_stub(cluster):
    return decode_pb2_grpc.DecodeWorkerStub(cluster[1]["decode"])


def worker_request(request_id, prompt, **sampling):
    params = SamplingParams(**({"temperature": 0.0, "max_tokens": MAX_TOKENS} | sampling))
    return worker_pb2.WorkerRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
    )


def play_router(cluster, producer, request_id, prompt, *, lease_seconds=0, before_decode=None):
    """Prefill on `producer`, then Decode with the handle; returns (tokens, responses)."""
    request = worker_request(request_id, prompt)
    prefilled = prefill_stub(cluster, producer).Prefill(
        prefill_pb2.PrefillRequest(request=request, lease_seconds=lease_seconds), timeout=TIMEOUT_S
    )
    if before_decode is not None:
        before_decode(prefilled)
    decode = decode_pb2.DecodeRequest(
        request=request, first_token=prefilled.first_token, kv_handle=prefilled.kv_handle
    )
    responses = list(decode_stub(cluster).Decode(decode, timeout=TIMEOUT_S))
    tokens = [prefilled.first_token] + [t for r in responses for t in r.token_ids]
    return tokens, responses


def used_blocks(cluster) -> int:
    load = decode_stub(cluster).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return load.kv_blocks_total - load.kv_blocks_free - load.kv_blocks_cached


@pytest.mark.parametrize("producer", ["prefill-shm", "prefill-grpc"])
def test_decode_of_prefilled_handles_matches_transformers(cluster, tiny_llama, producer):
    prompts = make_prompts(MIXED_LENS, seed=31)
    results: dict[int, tuple] = {}

    def run(i):
        results[i] = play_router(cluster, producer, f"{producer}-{i}", prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert len(results) == len(prompts)
    for i, prompt in enumerate(prompts):
        tokens, responses = results[i]
        want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
        assert tokens == want, f"prompt {i} ({len(prompt)} tokens)"
        last = responses[-1]
        ends = (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert last.finish_reason in ends
        assert last.num_generated == len(tokens)
        assert not any(r.recomputed_prompt for r in responses)
        assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert max(len(results[i][1]) for i in results) > 1, "tokens must be streamed"
    assert wait_until(lambda: used_blocks(cluster) == 0)


def test_expired_lease_is_recomputed_with_the_same_tokens(cluster, tiny_llama):
    (prompt,) = make_prompts((70,), seed=32)
    tokens, responses = play_router(
        cluster, "prefill-shm", "expired", prompt, lease_seconds=1,
        before_decode=lambda _: time.sleep(1.3),
    )  # fmt: skip
    assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]
    assert responses[-1].recomputed_prompt


def test_handle_of_a_dead_producer_is_recomputed(cluster, tiny_llama):
    procs = cluster[0]
    prompts = make_prompts((45, 20), seed=33)

    def kill_producer(_):
        procs["prefill-doomed"].proc.kill()
        procs["prefill-doomed"].proc.wait(10)

    tokens, responses = play_router(
        cluster, "prefill-doomed", "orphan", prompts[0], before_decode=kill_producer
    )
    assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompts[0]))[0]
    assert responses[-1].recomputed_prompt


def test_abort_and_cancel_free_every_block_at_once(cluster):
    stub = decode_stub(cluster)
    (prompt,) = make_prompts((40,), seed=34)
    assert used_blocks(cluster) == 0
    long = {"max_tokens": 1900, "ignore_eos": True}

    request = worker_request("to-abort", prompt, **long)
    stream = stub.Decode(decode_pb2.DecodeRequest(request=request, first_token=5), timeout=60)
    first = next(stream)
    assert first.token_ids and used_blocks(cluster) > 0
    assert stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=5).found
    assert used_blocks(cluster) == 0  # freed by the Abort call itself
    rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not stub.Abort(common_pb2.AbortRequest(request_id="to-abort"), timeout=5).found

    request = worker_request("to-cancel", prompt, **long)
    stream = stub.Decode(decode_pb2.DecodeRequest(request=request, first_token=5), timeout=60)
    next(stream)
    assert used_blocks(cluster) > 0
    stream.cancel()
    assert wait_until(lambda: used_blocks(cluster) == 0, timeout_s=2.0)
    assert not stub.Abort(common_pb2.AbortRequest(request_id="to-cancel"), timeout=5).found


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"request_id": ""}, "request.request_id"),
        ({"prompt": [1, 99999]}, "request.prompt_token_ids"),
        ({"prompt": []}, "request.prompt_token_ids"),
        ({"sampling": {"top_p": 2.0}}, "request.sampling.top_p"),
        ({"first_token": 99999}, "first_token"),
    ],
)
def test_bad_request_is_invalid_argument_naming_the_field(cluster, change, field):
    request_id, prompt = change.get("request_id", "bad"), change.get("prompt", [1, 2, 3])
    request = worker_request(request_id, prompt, **change.get("sampling", {}))
    decode = decode_pb2.DecodeRequest(request=request, first_token=change.get("first_token", 4))
    with pytest.raises(grpc.RpcError) as info:
        list(decode_stub(cluster).Decode(decode, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    rpc_status.from_call(info.value).details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == field


def test_imported_blocks_are_published_to_the_prefix_index(cluster, module_redis):
    """The blocks a decode worker pulls from a prefill worker are in its own index entries
    (the router's next turn counts them); the prefill workers here run without Redis."""
    (prompt,) = make_prompts((40,), seed=37)  # 2 full blocks
    handles = []
    play_router(cluster, "prefill-shm", "indexed", prompt, before_decode=handles.append)
    hashes = list(handles[0].kv_handle.block_hashes)
    index = RedisPrefixIndex(connect(module_redis.url), "tiny")
    assert wait_until(lambda: index.lookup(hashes) == {"decode-a": 2}, 10.0), index.lookup(hashes)


def test_registered_in_redis_then_sigterm_drains_the_stream_in_flight(cluster, module_redis):
    procs = cluster[0]
    registry = WorkerRegistry(connect(module_redis.url), "tiny")
    (live,) = registry.live_workers(Role.DECODE)
    assert (live.worker_id, live.address) == ("decode-a", procs["decode"].address)

    (prompt,) = make_prompts((10,), seed=35)
    request = worker_request("draining", prompt, max_tokens=300, ignore_eos=True)
    stream = decode_stub(cluster).Decode(
        decode_pb2.DecodeRequest(request=request, first_token=5), timeout=60
    )
    next(stream)
    procs["decode"].proc.send_signal(signal.SIGTERM)
    responses = list(stream)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert responses[-1].num_generated == 300
    assert procs["decode"].proc.wait(timeout=20) == 0
    assert registry.live_workers(Role.DECODE) == []


def test_shared_system_prompt_is_one_device_copy_pulled_once(cluster, tiny_llama):
    """In-process decode worker (to see ref counts) against the real prefill process: ten
    requests sharing a 500-token system prompt, imported at the same time."""
    engine = DecodeEngine.from_model_dir(
        str(tiny_llama),
        DecodeEngineConfig(block_size=BLOCK_SIZE, num_blocks=256, num_swap_blocks=0),
    )
    worker = DecodeWorker(engine, import_threads=10)
    g = torch.Generator().manual_seed(36)
    system = torch.randint(3, 512, (500,), generator=g).tolist()
    prompts = [system + torch.randint(3, 512, (20,), generator=g).tolist() for _ in range(10)]
    prefills = [
        prefill_stub(cluster, "prefill-shm").Prefill.future(
            prefill_pb2.PrefillRequest(request=worker_request(f"sys-{i}", p)), timeout=TIMEOUT_S
        )
        for i, p in enumerate(prompts)
    ]
    calls = [
        convert.decode_call(
            decode_pb2.DecodeRequest(
                request=worker_request(f"sys-{i}", prompts[i]),
                first_token=f.result().first_token,
                kv_handle=f.result().kv_handle,
            )
        )
        for i, f in enumerate(prefills)
    ]
    # hold every pull until all ten imports have reserved their blocks: they overlap for sure
    num_shared = 500 // BLOCK_SIZE
    importer, pull = worker.importer, worker.importer._pull
    all_reserved = threading.Event()

    def gated_pull(handle, blocks):
        all_reserved.wait(10)
        pull(handle, blocks)

    importer._pull = gated_pull  # type: ignore[method-assign]
    try:
        streams = [worker.submit(call) for call in calls]
        assert wait_until(lambda: importer.stats.blocks_shared_in_flight == 9 * num_shared)
        all_reserved.set()
        assert wait_until(lambda: len(engine.scheduler.running) == 10)
        assert importer.stats.num_imported == 10 and importer.stats.num_recomputed == 0
        tables = [entry.seq.block_table.block_ids for entry in engine.scheduler.running]
        shared = tables[0][:num_shared]
        assert all(t[:num_shared] == shared for t in tables)
        assert [engine.pool.ref_count(b) for b in shared] == [10] * num_shared
        assert len({b for t in tables for b in t}) == num_shared + 10 * 2
        assert importer.stats.blocks_pulled_shm == num_shared + 10 * 2  # each hash pulled once
        assert importer.stats.blocks_pulled_grpc == 0
        engine.check_integrity()

        worker.start()
        for call, stream, prompt in zip(calls, streams, prompts, strict=True):
            tokens, delta = [call.first_token], None
            while delta is None or delta.finish_reason is None:
                delta = stream.get(TIMEOUT_S)
                assert delta is not None
                tokens += delta.token_ids
            assert not delta.recomputed_prompt
            assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]
    finally:
        worker.close()
    engine.check_integrity()
    assert engine.pool.num_used == 0
