"""The prefill worker's edge: `pagedserve.v1` messages <-> engine calls and results."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from pagedserve.internal.v1 import prefill_pb2, worker_pb2
from pagedserve.kvstore.kv_cache import SCALE_LAYOUT
from pagedserve.kvstore.transfer import BlockChunk, ShmOffer
from pagedserve.model.requests.convert import (
    finish_reason_to_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
)
from pagedserve.prefill_worker.engine import PrefillEngine
from pagedserve.prefill_worker.worker import PrefillResult
from pagedserve.protoconv import worker_request_fields
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker_load import WorkerLoad

HANDLE_VERSION = 1


@dataclass(frozen=True, slots=True)
class PrefillCall:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str
    lease_seconds: float


def prefill_call(msg: prefill_pb2.PrefillRequest) -> PrefillCall:
    return PrefillCall(**worker_request_fields(msg.request), lease_seconds=float(msg.lease_seconds))


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this worker is, as written into every handle."""

    worker_id: str
    incarnation: str
    address: str


def prefill_response(
    result: PrefillResult, engine: PrefillEngine, me: Identity, trace_context: dict[str, str]
) -> prefill_pb2.PrefillResponse:
    seq = result.seq
    response = prefill_pb2.PrefillResponse(
        request_id=seq.request_id,
        first_token=seq.output_token_ids[0],
        cached_tokens=seq.num_cached_prompt_tokens,
        computed_tokens=seq.num_prompt_tokens - seq.num_cached_prompt_tokens,
        prompt_logprobs=prompt_logprobs_to_proto(seq),
    )
    if seq.output_logprobs and seq.output_logprobs[0] is not None:
        response.logprobs.CopyFrom(logprobs_to_proto(seq.output_logprobs[0]))
    if seq.fork_first_tokens:
        eos, max_len = engine.model_config.eos_token_ids, engine.max_model_len
        first = (seq.output_token_ids[0], seq.output_logprobs[0])
        for token_id, logprobs in [first, *seq.fork_first_tokens]:
            sample = response.samples.add(token_id=token_id)
            if logprobs is not None:
                sample.logprobs.CopyFrom(logprobs_to_proto(logprobs))
            reason = seq.first_token_finish(token_id, max_len, eos)
            if reason is not None:
                sample.finish_reason = finish_reason_to_proto(reason)
    for token_id, logprob in seq.beam_candidates:
        sample = response.samples.add(token_id=token_id)
        sample.logprobs.sampled.token_id = token_id
        sample.logprobs.sampled.logprob = logprob
    if result.lease is None:
        response.finish_reason = finish_reason_to_proto(seq.finish_reason)
        return response
    response.kv_handle.CopyFrom(kv_handle(result, engine, me, trace_context))
    return response


def kv_handle(
    result: PrefillResult, engine: PrefillEngine, me: Identity, trace_context: dict[str, str]
) -> worker_pb2.KvHandle:
    assert result.lease is not None
    seq, spec = result.seq, engine.runner.spec
    num_full = seq.num_prompt_tokens // spec.block_size
    handle = worker_pb2.KvHandle(
        version=HANDLE_VERSION,
        handle_id=result.lease.handle_id,
        producer_id=me.worker_id,
        producer_incarnation=me.incarnation,
        producer_address=me.address,
        request_id=seq.request_id,
        num_tokens=seq.num_prompt_tokens,
        block_size=spec.block_size,
        block_ids=result.lease.resource.block_ids,
        block_hashes=seq.block_hashes[:num_full],
        layout=worker_pb2.KvLayout(
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype_name,
            block_size=spec.block_size,
            compat_hash=engine.compat_hash,
            scale_layout=SCALE_LAYOUT if spec.quantized else "",
            tensor_parallel_size=engine.config.tensor_parallel_size,
        ),
        lease_expires_unix_ms=result.lease_expires_unix_ms,
        grpc=worker_pb2.GrpcTransport(address=me.address),
        trace_context=trace_context,
    )
    offers = engine.shm_offers()
    if offers:
        handle.shm.CopyFrom(shm_transport(offers[0]))
    if engine.config.tensor_parallel_size > 1:
        handle.shards.extend(
            worker_pb2.KvShard(rank=rank, shm=shm_transport(offer) if offer else None)
            for rank, offer in enumerate(offers or [None] * engine.config.tensor_parallel_size)
        )
    return handle


def shm_transport(offer: ShmOffer) -> worker_pb2.ShmTransport:
    return worker_pb2.ShmTransport(**asdict(offer))  # NOTE: the message's fields, by name


def kv_chunk(chunk: BlockChunk) -> prefill_pb2.KvChunk:
    return prefill_pb2.KvChunk(
        block_index=chunk.block_index,
        block_id=chunk.block_id,
        data=chunk.data,
        offset=chunk.offset,
        last_of_block=chunk.last_of_block,
    )


def worker_load(engine: PrefillEngine, draining: bool) -> WorkerLoad:
    """The engine's load now (sent by `GetLoad` and by the registry heartbeat)."""
    pool = engine.pool
    computed, cached = engine.num_prompt_tokens_computed, engine.num_prompt_tokens_cached
    total = computed + cached
    return WorkerLoad(
        num_requests_running=len(engine.scheduler.running),
        num_requests_waiting=engine.scheduler.num_waiting,
        queued_prefill_tokens=engine.scheduler.queued_tokens,
        kv_blocks_total=pool.num_blocks,
        kv_blocks_free=pool.num_free,
        kv_blocks_cached=pool.num_cached,
        kv_cache_usage=pool.usage,
        prefix_cache_hit_rate=cached / total if total else 0.0,
        draining=draining,
        reported_at_unix_ms=int(time.time() * 1000),
        tensor_parallel_size=engine.config.tensor_parallel_size,
    )
