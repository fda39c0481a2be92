"""`KvImporter`: brings a prefilled prompt's KV into the decode worker's pool (docs/leases.md).

One import, on an import thread (never the engine loop)::

    check     version, compat_hash, block size, prompt length, our own block hashes, lease
    reserve   (engine lock) per full block: reuse the block holding its hash, or share a block
              another import is pulling right now, or allocate one to pull; the partial last
              block is always pulled
    pull      only our own blocks: shm if on the producer's host and the segment attaches,
              else gRPC PullKv with block_indices; with tensor parallelism each rank's shard
              once (a head replicated on several ranks travels once), the shards at once
    release   ReleaseKv: the bytes count only if it answers found=true (lease held to the end)
    publish   (engine lock) register our pulled blocks by hash; wake imports sharing them
    finish    wait for the shared blocks' owners; all good -> the table holds the prompt's KV

Fail closed: any check, pull, release or shared-block failure frees the table and returns the
reason; the caller then recomputes the prompt. An abort (`ImportCancel.cancel`) stops the pull at
once: the table is freed first, then the lease is released. In-flight blocks are keyed by hash,
so two requests importing the same prompt at once end up referencing one device copy, pulled once.

NOTE: an import publishes its own blocks before waiting on others', so no two imports ever
wait on each other.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from pagedserve.core_share import one_torch_thread
from pagedserve.decode_worker import convert
from pagedserve.decode_worker.convert import KvHandleInfo
from pagedserve.decode_worker.engine import DecodeEngine
from pagedserve.grpcutil import RECONNECT_OPTIONS, ClientTLS, make_channel
from pagedserve.internal.v1 import prefill_pb2_grpc
from pagedserve.kvstore.block_pool import BlockId
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.kvstore.transfer import (
    BlockAssembler,
    ShmBlockReader,
    ShmOffer,
    TransferError,
    host_id,
    layout_compat_hash,
)
from pagedserve.model.requests.sequence import Sequence
from pagedserve.model.tensor_parallel import Shard

log = logging.getLogger(__name__)

HANDLE_VERSION = 1
MIN_LEASE_LEFT_S = 0.05  # a lease this close to expiry is treated as expired
PULL_CHUNK_BYTES = 1 << 20
RELEASE_TIMEOUT_S = 5.0
SHARED_WAIT_S = 120.0  # bound on waiting for another import's pull of a shared block
SHARD_PULLS_PER_RANK = 4  # tensor parallel: other ranks' shard pulls at once, per rank (the
# decode worker's default --import-threads: every import's shards can be in flight together)
MAX_SHM_READERS = 64


@dataclass(slots=True)
class ImportStats:
    """Cumulative counters (`pagedserve:kv_import_*`)."""

    num_imported: int = 0
    num_recomputed: int = 0
    blocks_pulled_shm: int = 0
    blocks_pulled_grpc: int = 0
    blocks_reused: int = 0  # full blocks this worker already held (prefix cache hit)
    blocks_shared_in_flight: int = 0  # full blocks another import was pulling at the time
    blocks_looked_up: int = 0  # full blocks of every checked handle
    recompute_reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def blocks_pulled(self) -> int:
        return self.blocks_pulled_shm + self.blocks_pulled_grpc


@dataclass(slots=True, eq=False)
class _InFlight:
    """A block some import is pulling; others with the same hash share it."""

    block_id: BlockId
    depth: int = 0  # its index in the prompt: the pool evicts leaves before roots
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


@dataclass(slots=True)
class _Reservation:
    pull: dict[int, BlockId]  # handle block index -> our block, to pull ourselves
    owned: dict[BlockHash, _InFlight]  # our pulled full blocks, published by hash
    shared: list[_InFlight]  # others' pulls we wait for


class ImportCancel:
    """Lets an abort stop one import's pull at once (thread-safe; cancelling twice is fine)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[grpc.RpcContext] = []  # NOTE: one per tensor-parallel shard at most
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def attach(self, call: grpc.RpcContext) -> None:
        """A pull in flight; cancelled at once if the import already was."""
        with self._lock:
            self._calls.append(call)
            cancelled = self.cancelled
        if cancelled:
            call.cancel()


@dataclass(slots=True)
class TransferReport:
    """What one import did, for its `kv.transfer` span."""

    transport: str = "none"  # "shm", "grpc" or "none" (nothing pulled)
    blocks_pulled: int = 0
    blocks_skipped: int = 0  # held here already, or pulled once by a concurrent import
    bytes: int = 0
    outcome: str = "ok"  # or the reason the prompt is recomputed


class ProducerClients:
    """gRPC channels to prefill workers, one per address, kept for the worker's life."""

    def __init__(self, max_message_bytes: int = 64 << 20, tls: ClientTLS | None = None) -> None:
        self._lock = threading.Lock()
        self._tls = tls
        self._stubs: dict[str, prefill_pb2_grpc.PrefillWorkerStub] = {}
        self._channels: list[grpc.Channel] = []
        # NOTE: `pagedserve up` restarts a prefill worker at its address
        self._options = [("grpc.max_receive_message_length", max_message_bytes), *RECONNECT_OPTIONS]

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillWorkerStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = make_channel(address, self._tls, self._options)
                self._channels.append(channel)
                stub = self._stubs[address] = prefill_pb2_grpc.PrefillWorkerStub(channel)
            return stub

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()


class KvImporter:
    """Imports handles into `engine`'s pool. Thread-safe: every pool access holds `lock`, the
    lock the engine loop holds around `step()`; copies run without it, into blocks only this
    import references (so nothing else reads or writes them meanwhile)."""

    def __init__(
        self,
        engine: DecodeEngine,
        lock: threading.RLock,
        producers: ProducerClients,
        *,
        now_host_id: Callable[[], str] = host_id,
    ) -> None:
        self.engine = engine
        self.lock = lock
        self.producers = producers
        self.compat_hash = layout_compat_hash(
            engine.runner.spec, engine.fingerprint, engine.config.tensor_parallel_size
        )
        self.host_id = now_host_id()
        self.stats = ImportStats()
        self._in_flight: dict[BlockHash, _InFlight] = {}
        self._readers: dict[str, ShmBlockReader] = {}
        self._readers_lock = threading.Lock()
        self._local = threading.local()  # `cancel`: the ImportCancel of this thread's import
        self._warned_layouts: set[str] = set()  # producers whose KV layout differs from ours
        # tensor parallel: the other ranks' shards of an import are pulled here meanwhile
        shards = len(self._shard_sources())
        self._shard_pool = ThreadPoolExecutor(
            max(1, (shards - 1) * SHARD_PULLS_PER_RANK),
            thread_name_prefix="kv-shard",
            initializer=one_torch_thread,
        )

    def import_kv(
        self,
        seq: Sequence,
        handle: KvHandleInfo | None,
        report: TransferReport | None = None,
        cancel: ImportCancel | None = None,
    ) -> str | None:
        """Fill `seq`'s empty table with the KV of its prompt from `handle`.

        Returns None on success: the table holds the prompt's blocks (full ones registered by
        hash) and `seq.num_computed_tokens` is the prompt length; the caller must hand `seq`
        to the engine (which then owns the blocks). Otherwise returns why the prompt must be
        recomputed, with the table empty and the lease released (best effort). `report`, when
        given, is filled in for tracing; `cancel` lets an abort stop the pull.
        """
        report = report if report is not None else TransferReport()
        reason = self._import_kv(seq, handle, report, cancel or ImportCancel())
        report.outcome = reason or "ok"
        return reason

    def _import_kv(
        self,
        seq: Sequence,
        handle: KvHandleInfo | None,
        report: TransferReport,
        cancel: ImportCancel,
    ) -> str | None:
        reason = self._check(seq, handle)
        if reason is not None or handle is None:
            reason = reason or "no handle"
            if handle is not None and reason != "lease expired":
                self._release_quietly(handle)
            return self._gave_up(seq, reason)
        with self.lock:
            reservation = self._reserve(seq, handle)
        if reservation is None:
            self._release_quietly(handle)
            return self._gave_up(seq, "no free blocks")
        report.blocks_pulled = len(reservation.pull)
        report.blocks_skipped = len(handle.block_ids) - len(reservation.pull)
        report.bytes = len(reservation.pull) * self.engine.runner.spec.bytes_per_block
        pulled = self._pull_and_release(seq, handle, reservation, report, cancel)
        self._publish(reservation, pulled is True)
        if pulled is not True:
            with self.lock:
                self.engine.kv.free(seq.block_table)
            if pulled is None:
                # NOTE: after the free: an abort's blocks come back without waiting on the producer
                self._release_quietly(handle)
            if cancel.cancelled:
                return "aborted"
            return self._gave_up(seq, "pull failed or lease lost")
        for shared in reservation.shared:
            if not shared.done.wait(SHARED_WAIT_S) or not shared.ok:
                return self._fail(seq, "shared block's pull failed")
        with self.lock:
            n = seq.num_prompt_tokens
            self.engine.kv.cache_full_blocks(seq.block_table, seq.block_hashes, n)
            seq.num_computed_tokens = n
            seq.num_cached_prompt_tokens = n
            self.stats.num_imported += 1
        return None

    # -- check ---------------------------------------------------------------------------------

    def _check(self, seq: Sequence, handle: KvHandleInfo | None) -> str | None:
        if handle is None:
            return "no handle"
        bs = self.engine.pool.block_size
        n = seq.num_prompt_tokens
        num_full = n // bs
        with self.lock:
            self.stats.blocks_looked_up += num_full
        if handle.version != HANDLE_VERSION:
            return f"unknown handle version {handle.version}"
        ranks_differ = self._ranks_differ(handle)
        if ranks_differ is not None:
            return ranks_differ
        if handle.compat_hash != self.compat_hash:
            return self._layout_differs(handle)
        if handle.block_size != bs or handle.layout_block_size != bs:
            return f"block size {handle.block_size} is not ours ({bs})"
        if handle.num_tokens != n or len(handle.block_ids) != -(-n // bs):
            return "handle does not cover the prompt"
        # NOTE: our own hashes of the prompt must match: a wrong handle never enters the cache
        if list(handle.block_hashes) != seq.block_hashes[:num_full]:
            return "block hashes differ from the prompt's"
        if handle.lease_left_s() < MIN_LEASE_LEFT_S:
            return "lease expired"
        if not handle.grpc_address and not self._shm_offered(handle):
            return "no usable transport"
        return None

    def _ranks_differ(self, handle: KvHandleInfo) -> str | None:
        """Why a handle cannot reach our tensor-parallel ranks (None if it can): the same
        number of ranks on both sides, a shard per rank, our ranks' caches in reach."""
        ranks = self.engine.config.tensor_parallel_size
        if handle.tensor_parallel_size != ranks:
            return (
                f"the producer has {handle.tensor_parallel_size} tensor-parallel ranks, we have "
                f"{ranks} (give both workers the same --tensor-parallel-size)"
            )
        if handle.shards and len(handle.shards) != ranks:
            return f"the handle offers {len(handle.shards)} shards for {ranks} ranks"
        if self.engine.runner.kv_caches is None:
            return "our tensor-parallel ranks' KV caches are out of reach (not host memory)"
        return None

    def _layout_differs(self, handle: KvHandleInfo) -> str:
        """Why a handle of another layout is refused; a producer whose KV dtype differs from
        ours is named in a warning once (every hand-off from it will be recomputed)."""
        ours = self.engine.runner.spec.dtype_name
        if not handle.layout_dtype or handle.layout_dtype == ours:
            return "layout compat_hash differs"
        reason = (
            f"layout compat_hash differs: the producer stores {handle.layout_dtype} KV, we "
            f"store {ours} (give both workers the same --kv-cache-dtype)"
        )
        if handle.producer_id not in self._warned_layouts:
            self._warned_layouts.add(handle.producer_id)
            log.warning("%s: every hand-off is recomputed: %s", handle.producer_id, reason)
        return reason

    def _shm_offered(self, handle: KvHandleInfo) -> bool:
        """Whether every rank's shard is offered in shared memory on our host."""
        offers = handle.shards or (handle.shm,)
        return all(offer is not None and self._shm_usable(offer) for offer in offers)

    def _shm_usable(self, offer: ShmOffer) -> bool:
        return offer.host_id == self.host_id

    # -- reserve (engine lock held) ------------------------------------------------------------

    def _reserve(self, seq: Sequence, handle: KvHandleInfo) -> _Reservation | None:
        pool, bs = self.engine.pool, self.engine.pool.block_size
        n = seq.num_prompt_tokens
        hashes = seq.block_hashes[: n // bs]
        found: dict[int, BlockId] = {}
        shared: dict[int, _InFlight] = {}
        for i, h in enumerate(hashes):
            block = pool.lookup(h)
            if block is not None:
                found[i] = block
            elif h in self._in_flight:
                shared[i] = self._in_flight[h]
        num_blocks = len(handle.block_ids)
        to_pull = [i for i in range(num_blocks) if i not in found and i not in shared]
        revived = sum(pool.ref_count(b) == 0 for b in set(found.values()))
        if len(to_pull) + revived > pool.num_allocatable:
            return None
        pool.acquire([*found.values(), *(s.block_id for s in shared.values())])
        new_blocks = pool.allocate(len(to_pull))
        if new_blocks is None:
            raise RuntimeError("kv import: pool ran short after it said it would not")
        if self.engine.swapper is not None:
            # NOTE: a freed block may still be the source of a pending swap-out
            self.engine.swapper.wait_for_writes(new_blocks)
        pull = dict(zip(to_pull, new_blocks, strict=True))
        owned = {hashes[i]: _InFlight(b, i) for i, b in pull.items() if i < len(hashes)}
        self._in_flight.update(owned)
        table = seq.block_table
        table.block_ids = [_block_at(i, found, shared, pull) for i in range(num_blocks)]
        table.num_tokens = n
        self.stats.blocks_reused += len(found)
        self.stats.blocks_shared_in_flight += len(shared)
        return _Reservation(pull, owned, list(shared.values()))

    # -- pull ----------------------------------------------------------------------------------

    def _pull_and_release(
        self,
        seq: Sequence,
        handle: KvHandleInfo,
        reservation: _Reservation,
        report: TransferReport,
        cancel: ImportCancel,
    ) -> bool | None:
        """Copy our blocks, then end the lease. True only if ReleaseKv confirmed it; False if
        the lease had ended; None if the pull failed or was cancelled (lease not released)."""
        if not reservation.pull:
            self._release_quietly(handle)
            return True
        try:
            if cancel.cancelled:
                return None
            self._local.cancel = cancel  # NOTE: per import thread; `_pull_grpc` attaches its call
            report.transport = self._pull(handle, reservation.pull)
            found = self.producers.stub(handle.producer_address or handle.grpc_address).ReleaseKv(
                convert.release_request(handle), timeout=RELEASE_TIMEOUT_S
            )
        except (TransferError, grpc.RpcError, ValueError) as exc:
            if not cancel.cancelled:
                log.warning(
                    "%s: KV pull from %s failed: %s", seq.request_id, handle.producer_id, exc
                )
            return None
        if not found.found:
            log.warning(
                "%s: lease %s ended before the copy finished", seq.request_id, handle,
                extra={"request_id": seq.request_id},
            )  # fmt: skip
        return bool(found.found)

    def _pull(self, handle: KvHandleInfo, blocks: dict[int, BlockId]) -> str:
        """Copy `blocks` over the best transport, every tensor-parallel rank's shard once and
        the shards at the same time (this thread pulls the first); returns the transport's
        name ("grpc" if any shard took it)."""
        caches = self.engine.runner.kv_caches
        assert caches is not None  # NOTE: `_check` refused the handle otherwise
        cancel = getattr(self._local, "cancel", None)

        def pull(rank: int, replicas: list[int]) -> str:
            self._local.cancel = cancel  # NOTE: a shard thread's gRPC call stops on abort too
            transport = self._pull_shard(handle, blocks, rank, caches[rank])
            ids = torch.tensor(sorted(blocks.values()), dtype=torch.int64)
            for replica in replicas:  # NOTE: ranks holding the same KV heads: one pull
                caches[replica].tensor[ids] = caches[rank].tensor[ids]
            return transport

        (first, first_replicas), *others = self._shard_sources().items()
        pending = [self._shard_pool.submit(pull, rank, replicas) for rank, replicas in others]
        try:
            transports = [pull(first, first_replicas)]
        finally:
            # NOTE: every shard's outcome is waited for: none writes our blocks after we return
            for done in pending:
                done.exception()
        transports += [done.result() for done in pending]  # raises the first shard's error
        return "grpc" if "grpc" in transports else transports[0]

    def _shard_sources(self) -> dict[int, list[int]]:
        """{rank to pull: the other ranks holding the same KV heads}. With fewer KV heads than
        ranks a head is replicated (model/tensor_parallel.py): its blocks travel once."""
        size = self.engine.config.tensor_parallel_size
        if size == 1:
            return {0: []}
        sources: dict[int, list[int]] = {}
        first: dict[int, int] = {}
        for rank in range(size):
            head = Shard.of(self.engine.model_config, rank, size).first_kv_head
            if head in first:
                sources[first[head]].append(rank)
            else:
                first[head] = rank
                sources[rank] = []
        return sources

    def _pull_shard(
        self, handle: KvHandleInfo, blocks: dict[int, BlockId], rank: int, cache: KVCache
    ) -> str:
        """One rank's shard of `blocks` into `cache`; returns the transport's name."""
        indices = sorted(blocks)
        offer = handle.shards[rank] if handle.shards else handle.shm
        if offer is not None and self._shm_usable(offer):
            try:
                reader = self._reader(offer)
                src = [handle.block_ids[i] for i in indices]
                reader.read_blocks(src, cache, [blocks[i] for i in indices])
                with self.lock:
                    self.stats.blocks_pulled_shm += len(indices)
                return "shm"
            except TransferError as exc:
                if not handle.grpc_address:
                    raise
                log.info("shm transport unusable (%s); pulling over gRPC", exc)
        if not handle.grpc_address:
            raise TransferError(f"kv: no transport for rank {rank}'s shard")
        self._pull_grpc(handle, blocks, indices, rank, cache)
        return "grpc"

    def _pull_grpc(
        self,
        handle: KvHandleInfo,
        blocks: dict[int, BlockId],
        indices: list[int],
        rank: int,
        cache: KVCache,
    ) -> None:
        assembler = BlockAssembler(cache, dict(blocks))
        stream = self.producers.stub(handle.grpc_address).PullKv(
            convert.pull_request(handle, indices, PULL_CHUNK_BYTES, rank),
            timeout=max(handle.lease_left_s(), 1.0) + 5.0,
        )
        cancel = getattr(self._local, "cancel", None)
        if cancel is not None:
            cancel.attach(stream)
        for chunk in stream:
            assembler.feed(convert.block_chunk(chunk))
        if not assembler.complete:
            raise TransferError("kv: stream ended before every block arrived")
        with self.lock:
            self.stats.blocks_pulled_grpc += len(indices)

    def _reader(self, offer: ShmOffer) -> ShmBlockReader:
        with self._readers_lock:
            reader = self._readers.get(offer.segment_name)
            if reader is None:
                if len(self._readers) >= MAX_SHM_READERS:
                    # NOTE: oldest first; a reader still in use elsewhere keeps its mapping
                    self._readers.pop(next(iter(self._readers)))
                reader = ShmBlockReader(offer, self.engine.runner.spec)
                self._readers[offer.segment_name] = reader
            return reader

    def _release_quietly(self, handle: KvHandleInfo) -> None:
        """End the lease without waiting for the answer (the producer frees it at expiry anyway).

        NOTE: wait_for_ready: the call waits (up to RELEASE_TIMEOUT_S) for a channel that is
        reconnecting, as it is to a prefill worker just restarted at the same address; failing
        fast there left the lease's blocks held until it expired (30 s). Not waited for, so a
        dead producer does not hold up the recompute that usually follows."""
        address = handle.producer_address or handle.grpc_address
        if not address:
            return
        call = self.producers.stub(address).ReleaseKv.future(
            convert.release_request(handle), timeout=RELEASE_TIMEOUT_S, wait_for_ready=True
        )

        def done(ended: grpc.Future) -> None:
            if not ended.cancelled() and ended.exception() is not None:
                log.info("ReleaseKv %s at %s failed: %s", handle.handle_id, address, ended.code())

        call.add_done_callback(done)

    # -- publish and finish --------------------------------------------------------------------

    def _publish(self, reservation: _Reservation, ok: bool) -> None:
        """Register our pulled full blocks by hash (if good), then wake imports sharing them."""
        with self.lock:
            for block_hash, flight in reservation.owned.items():
                del self._in_flight[block_hash]
                if ok:
                    self.engine.pool.cache_block(flight.block_id, block_hash, flight.depth)
                flight.ok = ok
        for flight in reservation.owned.values():
            flight.done.set()

    def _fail(self, seq: Sequence, reason: str) -> str:
        with self.lock:
            self.engine.kv.free(seq.block_table)
        return self._gave_up(seq, reason)

    def _gave_up(self, seq: Sequence, reason: str) -> str:
        with self.lock:
            self.stats.num_recomputed += 1
            self.stats.recompute_reasons[reason] += 1
        log.info(
            "%s: recomputing the prompt (%s)", seq.request_id, reason,
            extra={"request_id": seq.request_id},
        )  # fmt: skip
        return reason

    def close(self) -> None:
        self._shard_pool.shutdown(wait=True, cancel_futures=True)
        with self._readers_lock:
            self._readers.clear()
        self.producers.close()


def _block_at(
    index: int,
    found: dict[int, BlockId],
    shared: dict[int, _InFlight],
    pull: dict[int, BlockId],
) -> BlockId:
    if index in found:
        return found[index]
    if index in shared:
        return shared[index].block_id
    return pull[index]
