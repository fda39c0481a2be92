"""The decode worker's edge: `pagedserve.v1` messages <-> our dataclasses, and a `DecodeCall`'s
validation (`new_sequence`: every field checked, named as in the `DecodeRequest`).

Only this module (and the gRPC client in kv_import.py) touches the generated classes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

from pagedserve.decode_worker.engine import DecodeEngine
from pagedserve.decode_worker.streams import Delta
from pagedserve.errors import InvalidArgument, ResourceExhausted
from pagedserve.internal.v1 import decode_pb2, prefill_pb2, worker_pb2
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.transfer import BlockChunk, ShmOffer
from pagedserve.model.requests.batch import TokenLogprobs
from pagedserve.model.requests.convert import (
    finish_reason_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
)
from pagedserve.model.requests.sequence import Sequence
from pagedserve.protoconv import worker_request_fields
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class KvHandleInfo:
    """A `KvHandle` as received; nothing in it is trusted until kv_import has checked it."""

    version: int
    handle_id: str
    producer_id: str
    producer_incarnation: str
    producer_address: str
    num_tokens: int
    block_size: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    layout_block_size: int
    compat_hash: bytes
    lease_expires_unix_ms: int
    shm: ShmOffer | None  # None: not offered
    grpc_address: str  # "": not offered
    layout_dtype: str = ""  # KvLayout.dtype: the producer's stored KV elements
    tensor_parallel_size: int = 1  # KvLayout.tensor_parallel_size: the producer's ranks
    shards: tuple[ShmOffer | None, ...] = ()  # a tensor-parallel producer's shm, by rank

    def lease_left_s(self) -> float:
        return self.lease_expires_unix_ms / 1000 - time.time()


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """A `DecodeRequest`, shape-checked (the engine validates ids and sampling values)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str
    first_token: int
    first_logprobs: TokenLogprobs | None
    handle: KvHandleInfo | None  # None: recompute the prompt here
    stream_interval: int = 1  # the least new tokens per DecodeResponse (the last: what is left)
    # Several samples: every sample's first token by index (the first is `first_token`)
    samples: tuple[tuple[int, TokenLogprobs | None], ...] = ()
    # No prefill worker ran it: compute the prompt and sample the first token here
    prefill_here: bool = False

    @property
    def num_samples(self) -> int:
        """Sequences this worker runs for the request (a beam search: its beams)."""
        return self.params.num_samples

    @property
    def num_outputs(self) -> int:
        """Sequences it streams back: every sample, or a beam search's n best beams."""
        return self.params.n if self.params.use_beam_search else self.params.num_samples


def decode_call(msg: decode_pb2.DecodeRequest) -> DecodeCall:
    """Raises InvalidArgument naming the field when `prefill_here` comes with what only a
    prefill worker gives (a first token, a KV handle, samples)."""
    if msg.prefill_here:
        given = [name for name in ("kv_handle", "first_logprobs") if msg.HasField(name)]
        given += ["first_token"] * (msg.first_token != 0) + ["samples"] * bool(msg.samples)
        if given:
            raise InvalidArgument(given[0], "must be unset with prefill_here")
    request = worker_request_fields(msg.request)
    if not msg.prefill_here:  # NOTE: the prefill worker returned them; a recompute sends none
        request["params"] = replace(request["params"], prompt_logprobs=None)
    return DecodeCall(
        **request,
        first_token=msg.first_token,
        first_logprobs=(
            logprobs_from_proto(msg.first_logprobs) if msg.HasField("first_logprobs") else None
        ),
        handle=kv_handle_info(msg.kv_handle) if msg.HasField("kv_handle") else None,
        stream_interval=max(1, msg.request.stream_interval),
        samples=tuple(
            (
                sample.token_id,
                logprobs_from_proto(sample.logprobs) if sample.HasField("logprobs") else None,
            )
            for sample in msg.samples
        ),
        prefill_here=msg.prefill_here,
    )


def new_sequence(call: DecodeCall, engine: DecodeEngine) -> Sequence:
    """The call's sequence for `engine`, its first token appended (unless a beam search or a
    prefill here chooses it). InvalidArgument naming the field as in the `DecodeRequest`,
    ResourceExhausted for a request `engine` can never hold."""
    if call.prefill_here and (call.num_samples > 1 or call.params.use_beam_search):
        raise InvalidArgument("prefill_here", "only for one sample without beam search")
    try:
        seq = engine.new_sequence(
            call.prompt_token_ids,
            call.params,
            request_id=call.request_id,
            priority=call.priority,
            cache_salt=call.cache_salt,
        )
    except InvalidArgument as exc:
        prefix = "request" if exc.field == "prompt_token_ids" else "request.sampling"
        raise exc.with_prefix(prefix) from None
    check_first_tokens(call, engine.model_config.vocab_size)
    if not engine.would_fit(seq.num_prompt_tokens, call.params.max_tokens, call.num_samples):
        raise ResourceExhausted(
            f"request needs more than this decode worker's {engine.pool.num_blocks} KV "
            f"blocks of {engine.pool.block_size}; lower max_tokens or use a larger worker"
        )
    if not (call.params.use_beam_search or call.prefill_here):
        # NOTE: the first beam step chooses the tokens; a prefill here samples the first
        seq.append_token(call.first_token, call.first_logprobs)
    return seq


def check_first_tokens(call: DecodeCall, vocab_size: int) -> None:
    """InvalidArgument naming the field: `first_token` and `samples` (every sample's first
    token, or a beam search's first candidates) must be in the vocabulary and match the
    sampling params."""
    if call.first_token >= vocab_size:
        raise InvalidArgument("first_token", f"{call.first_token} is not < {vocab_size}")
    params, samples = call.params, call.samples
    if any(token >= vocab_size for token, _ in samples):
        raise InvalidArgument("samples", f"a token is not < {vocab_size}")
    if params.use_beam_search:
        if len(samples) < min(params.beam_size, vocab_size) or any(lp is None for _, lp in samples):
            raise InvalidArgument(
                "samples", f"a beam search of {params.beam_size} beams needs at least as "
                "many candidates (token, logprob)"
            )  # fmt: skip
        return
    if call.num_samples > 1 and len(samples) != call.num_samples:
        raise InvalidArgument(
            "samples", f"{call.num_samples} samples asked, {len(samples)} first tokens given"
        )
    if call.num_samples == 1 and samples:
        raise InvalidArgument("samples", "given for a request with one sample")
    if samples and samples[0][0] != call.first_token:
        raise InvalidArgument("samples", "samples[0] must repeat first_token")


def shm_offer(msg: worker_pb2.ShmTransport) -> ShmOffer:
    return ShmOffer(**{f.name: getattr(msg, f.name) for f in fields(ShmOffer)})


def kv_handle_info(msg: worker_pb2.KvHandle) -> KvHandleInfo:
    """InvalidArgument naming the field for shards out of rank order."""
    shm = shm_offer(msg.shm) if msg.HasField("shm") else None
    if [shard.rank for shard in msg.shards] != list(range(len(msg.shards))):
        raise InvalidArgument("kv_handle.shards", "must list every rank once, in rank order")
    shards = tuple(shm_offer(s.shm) if s.HasField("shm") else None for s in msg.shards)
    return KvHandleInfo(
        version=msg.version,
        handle_id=msg.handle_id,
        producer_id=msg.producer_id,
        producer_incarnation=msg.producer_incarnation,
        producer_address=msg.producer_address,
        num_tokens=msg.num_tokens,
        block_size=msg.block_size,
        block_ids=tuple(msg.block_ids),
        block_hashes=tuple(BlockHash(h) for h in msg.block_hashes),
        layout_block_size=msg.layout.block_size,
        compat_hash=msg.layout.compat_hash,
        layout_dtype=msg.layout.dtype,
        tensor_parallel_size=max(1, msg.layout.tensor_parallel_size),
        shards=shards,
        lease_expires_unix_ms=msg.lease_expires_unix_ms,
        shm=shm,
        grpc_address=msg.grpc.address if msg.HasField("grpc") else "",
    )


def decode_response(request_id: str, delta: Delta) -> decode_pb2.DecodeResponse:
    response = decode_pb2.DecodeResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        num_generated=delta.num_generated,
        finish_reason=finish_reason_to_proto(delta.finish_reason),
        num_preemptions=delta.num_preemptions,
        recomputed_prompt=delta.recomputed_prompt,
        index=delta.index,
        cached_prompt_tokens=delta.cached_prompt_tokens,
    )
    if any(lp is not None for lp in delta.logprobs):
        response.logprobs.extend(
            logprobs_to_proto(lp) if lp is not None else common_pb2.Logprobs()
            for lp in delta.logprobs
        )
    response.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in delta.prompt_logprobs)
    if delta.matched_stop_token_id is not None:
        response.matched_stop_token_id = delta.matched_stop_token_id
    return response


def pull_request(handle: KvHandleInfo, indices: list[int], max_chunk_bytes: int, rank: int = 0):
    return prefill_pb2.PullKvRequest(
        handle_id=handle.handle_id,
        producer_incarnation=handle.producer_incarnation,
        block_indices=indices,
        max_chunk_bytes=max_chunk_bytes,
        rank=rank,
    )


def release_request(handle: KvHandleInfo) -> prefill_pb2.ReleaseKvRequest:
    return prefill_pb2.ReleaseKvRequest(handle_id=handle.handle_id)


def block_chunk(msg: prefill_pb2.KvChunk) -> BlockChunk:
    return BlockChunk(msg.block_index, msg.block_id, msg.offset, msg.data, msg.last_of_block)
