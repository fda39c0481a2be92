"""Where a request goes: the (prefill, decode) pair of lowest cost (docs/router.md).

    cost(p) = w_overlap * uncached_prefill_blocks(p) + w_load * queued_prefill_tokens(p) / bs
    cost(d) = w_decode * kv_usage(d) + w_queue * (running + waiting + in_flight)(d) / max_num_seqs
              - w_decode_overlap * cached_blocks(d) / prompt_blocks

`cached_blocks(w)` is what one prefix-index lookup per request says: the leading full blocks of
the prompt worker `w` holds. Prefill and decode workers both publish, so a conversation's next
turn (its prompt repeats the last prompt and answer) finds the decode worker that served the
last one cheaper by up to `w_decode_overlap`.

Conditional disaggregation (`LocalPrefill`, as NVIDIA Dynamo's disaggregated router does): the
decode worker computes the prompt itself (`Decision.prefill_here`) in two cases.

- Short prompts (off by default here, turned on by `pagedserve up`, one host) while the chosen
  prefill worker has a queue. Remote prefill keeps long prompts off the decode worker's steps
  (their TPOT); a short prompt costs the decode worker little (its chunk rides along a decode
  step) and would otherwise wait behind the queue. Measured (S1, SmolLM2, 2 cores): with the
  queue condition (2,048 tokens) median TTFT 0.53x, useful tok/s 0.90x; without it (`up`'s
  setting) TTFT 0.57x, tok/s 1.24x:

      prefill_here = prompt tokens <= max_tokens
                     and queued tokens of the chosen prefill worker >= queue_tokens

  The whole prompt counts: this rule is about the prefill worker's queue.
- Locality (on by default): the chosen decode worker holds more leading blocks of the prompt
  than the chosen prefill worker (a follow-up turn), so it computes only the uncached suffix
  from its own prefix cache and pulls no block, where a prefill worker would recompute more
  and send it all. Like Dynamo's `max_local_prefill_length` (compared with the part not cached
  at the decode worker) and llm-d's P/D threshold, the suffix is bounded, so a long new part
  still goes to a prefill worker:

      prefill_here = cached_blocks(d) > cached_blocks(p)
                     and prompt tokens - cached_blocks(d) * bs <= max_suffix_tokens

Both need a request of one sample without beam search (`num_tokens` given) and a decode worker
that accepts it (its LoadReport says so). `routes_*` counters say how often each path was taken
(Prometheus `pagedserve:routes_prefill_here_total`, `routes_prefill_here_locality_total`).

Tensor parallelism: KV moves only between workers of the same `--tensor-parallel-size` (each
worker's `LoadReport` says its count). The decode worker is chosen first, then the cheapest
prefill worker of its count; when none has it, the decode worker computes the prompt itself
(`routes_tensor_parallel_mismatch_total`), since it would refuse the hand-off and recompute the
prompt anyway. A request the decode worker cannot prefill (several samples, beam search) still
goes to a prefill worker of another count, and the decode worker recomputes its prompt.

Workers come from the static lists (`--prefill`, `--decode`) and, with Redis, from the registry
(live incarnations only). Load comes from polling each worker's `GetLoad` plus the requests this
router has in flight there (so a burst does not all land on the idlest worker). The prefix
overlap comes from the Redis index; when Redis is absent, down or slow the router routes by load
alone and says so (`index_degraded`), skips the index for `index_retry_s` after a failed lookup
(a slow Redis costs one bounded lookup per interval, not one per request), and recovers by itself
on the next successful lookup.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pagedserve.grpcutil import RECONNECT_OPTIONS, ClientTLS, make_channel
from pagedserve.internal.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from pagedserve.kvstore.hashing import BlockHash
from pagedserve.kvstore.prefix_index import IndexUnavailable, PrefixIndex
from pagedserve.kvstore.worker_registry import (
    RegistryUnavailable,
    Role,
    WorkerInfo,
    WorkerLoad,
    WorkerRegistry,
)
from pagedserve.protoconv import load_from_proto

log = logging.getLogger(__name__)
MAX_POLL_TIMEOUT_S = 4.0  # the longest a load poll waits for a busy worker
RETIRED_CHANNEL_GRACE_S = 600.0  # how long calls on a retired worker's channel may still run


@dataclass(frozen=True, slots=True)
class CostWeights:
    overlap: float = 1.0
    load: float = 1.0
    decode: float = 4.0
    queue: float = 1.0
    # per fraction of the prompt's full blocks already on the decode worker (its prefix
    # index entries): holding a whole conversation is worth 25 points of KV usage, or a
    # max_num_seqs worth of queued requests
    decode_overlap: float = 1.0


@dataclass(frozen=True, slots=True)
class LocalPrefill:
    """When the decode worker computes a prompt itself (see the module docstring)."""

    max_tokens: int = 0  # 0: never (the default); longer prompts go to a prefill worker
    queue_tokens: int = 2048  # only while the prefill worker has this many tokens queued
    # locality: the decode worker holds more of the prompt than the prefill worker, and at
    # most this many of its tokens are not cached there (0: never)
    max_suffix_tokens: int = 1024

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0


DEFAULT_LOCAL_PREFILL = LocalPrefill()


@dataclass(slots=True)
class RouteStats:
    """Routing decisions since start (Prometheus counters `pagedserve:routes_*_total`)."""

    prefill_worker: int = 0  # the prompt went to a prefill worker
    prefill_here: int = 0  # the decode worker computed it (conditional disaggregation)
    # of those, because no prefill worker had the decode worker's --tensor-parallel-size
    tensor_parallel_mismatch: int = 0
    # of those, because the decode worker held more of the prompt than the prefill worker
    prefill_here_locality: int = 0


@dataclass(slots=True)
class Worker:
    """One worker as the router sees it. `load` is the last GetLoad answer (None: never seen)."""

    worker_id: str
    address: str
    role: Role
    incarnation: str = ""
    channel: grpc.aio.Channel | None = None
    load: WorkerLoad | None = None
    in_flight: int = 0
    in_flight_tokens: int = 0  # prompt tokens of this router's Prefill calls not yet answered
    failures: int = 0
    stale: bool = False  # the last GetLoad timed out: `load` is the one before (slow, not dead)
    static: bool = False  # listed by --prefill/--decode: kept even when its record expires
    poll_timeout_s: float = 0.0  # grows while its polls time out (a busy worker is still seen)
    restarts: int = 0  # new incarnations of this worker id seen in the registry
    assigned: int = 0  # requests routed here so far: breaks ties between equal costs

    @property
    def healthy(self) -> bool:
        return self.load is not None and not self.load.draining and self.failures == 0


@dataclass(slots=True)
class Decision:
    prefill: Worker
    decode: Worker
    cached_blocks: int
    terms: dict[str, float | bool] = field(default_factory=dict)  # span attributes
    prefill_here: bool = False  # the decode worker computes the prompt (no prefill call)


class WorkerSet:
    """Membership, channels and load of every worker; refreshed by `refresh()` (a poller).

    The channels are `grpc.aio` channels: build the set on the event loop that serves."""

    def __init__(
        self,
        static_prefill: Sequence[str],
        static_decode: Sequence[str],
        registry: WorkerRegistry | None,
        *,
        max_message_bytes: int,
        tls: ClientTLS | None = None,
        compat: str = "",
    ) -> None:
        self._lock = threading.Lock()
        self._compat = compat  # `compat_tag` of this router; "" skips the check
        self.incompatible: dict[str, str] = {}  # worker id -> its compat tag (not routed to)
        self._tls = tls
        self._registry = registry
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *RECONNECT_OPTIONS,  # NOTE: else a restarted worker stays out of routing for long
        ]
        self._workers: dict[str, Worker] = {}
        self._closing: set[asyncio.Task] = set()  # retired channels waiting for their calls
        for role, addresses in ((Role.PREFILL, static_prefill), (Role.DECODE, static_decode)):
            for address in addresses:
                self._add(Worker(address, address, role, static=True))

    def _add(self, worker: Worker) -> Worker:
        worker.channel = make_channel(worker.address, self._tls, self._options, aio=True)
        self._workers[worker.worker_id] = worker
        return worker

    def workers(self, role: Role | None = None) -> list[Worker]:
        with self._lock:
            return [w for w in self._workers.values() if role is None or w.role is role]

    async def refresh(
        self, timeout_s: float = 0.5, *, sync_registry: bool = True, patient: bool = True
    ) -> None:
        """Pick up registry changes, then poll every worker's load (all at once). `patient`:
        a worker whose last poll timed out gets twice as long this time (up to
        `MAX_POLL_TIMEOUT_S`), so a worker too busy to answer within `timeout_s` is still seen;
        otherwise every poll gets `timeout_s` (GetClusterStatus: never waits long)."""
        if sync_registry and self._registry is not None:
            await self._sync_registry()
        await asyncio.gather(
            *(
                self._poll(w, max(timeout_s, w.poll_timeout_s) if patient else timeout_s, patient)
                for w in self.workers()
            )
        )

    async def _sync_registry(self) -> None:
        assert self._registry is not None
        try:
            live = await asyncio.to_thread(self._registry.live_workers)
        except RegistryUnavailable:
            return  # NOTE: keep the last membership; GetLoad polling still tracks health
        with self._lock:
            for info in live:
                if info.role not in (Role.PREFILL, Role.DECODE) or not self._compatible(info):
                    continue
                known = self._workers.get(info.worker_id) or self._rekey_static(
                    info.address, info.worker_id
                )
                if known is not None and known.incarnation not in ("", info.incarnation):
                    self._retire(known)
                    self._add(Worker(info.worker_id, info.address, info.role, info.incarnation,
                                     static=known.static, restarts=known.restarts + 1))  # fmt: skip
                    continue
                if known is None:
                    self._add(Worker(info.worker_id, info.address, info.role, info.incarnation))
                else:
                    known.incarnation = info.incarnation
            self._drop_expired({info.worker_id for info in live})

    def _drop_expired(self, live: set[str]) -> None:
        """Forget registry-found workers whose record is gone (deregistered, or its TTL ran out
        without a heartbeat) and that do not answer their polls either: a dead worker leaves
        routing and the status. NOTE: one that answers stays (Redis restarted and lost the
        record; the next heartbeat writes it again). Lock held."""
        for worker_id, worker in list(self._workers.items()):
            if not worker.static and worker_id not in live and not worker.healthy:
                log.info("worker %s left the registry; forgetting it", worker_id)
                del self._workers[worker_id]
                self._retire(worker)

    def _retire(self, worker: Worker) -> None:
        """A worker replaced by a new incarnation: its channel closes once the calls still on
        it end (bounded). NOTE: not at once: at the same address the channel may already carry
        calls to the new process, which a close would cancel."""
        if worker.channel is not None:
            task = asyncio.get_running_loop().create_task(
                worker.channel.close(grace=RETIRED_CHANNEL_GRACE_S)
            )
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _compatible(self, info: WorkerInfo) -> bool:
        """A registered worker whose block hashes would differ from the router's (another
        revision, dtype or block size under the same model name) is not routed to: its prefix
        hits would never match, and another revision gives other tokens. Logged once."""
        if not (self._compat and info.compat) or info.compat == self._compat:
            self.incompatible.pop(info.worker_id, None)
            return True
        if self.incompatible.get(info.worker_id) != info.compat:
            log.error(
                "worker %s at %s is not routed to: its model fingerprint/block size %s differs "
                "from this router's %s (check --dtype, --revision, --quantization and "
                "--block-size)",
                info.worker_id, info.address, info.compat, self._compat,
            )  # fmt: skip
        self.incompatible[info.worker_id] = info.compat
        return False

    def _rekey_static(self, address: str, worker_id: str) -> Worker | None:
        """A statically listed worker that registered too: known from now on by its id."""
        static = self._workers.pop(address, None)
        if static is not None:
            static.worker_id = worker_id
            self._workers[worker_id] = static
        return static

    async def _poll(self, worker: Worker, timeout_s: float, patient: bool) -> None:
        assert worker.channel is not None
        stub: Callable = (
            prefill_pb2_grpc.PrefillWorkerStub(worker.channel).GetLoad
            if worker.role is Role.PREFILL
            else decode_pb2_grpc.DecodeWorkerStub(worker.channel).GetLoad
        )
        try:
            answer = await stub(worker_pb2.GetLoadRequest(), timeout=timeout_s)
            worker.load = load_from_proto(answer)
            worker.failures = 0
            worker.stale = False
        except grpc.RpcError as err:
            # NOTE: slow is not dead: on a saturated host a busy worker answers GetLoad late, and
            # taking it out of routing would move its load onto the others. A timeout keeps the
            # last load (stale); only a failed connection or another error takes it out, and a
            # draining worker (NOT_SERVING) says so in its load
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                worker.stale = True
                if patient:
                    worker.poll_timeout_s = min(MAX_POLL_TIMEOUT_S, 2 * timeout_s)
            else:
                worker.failures += 1

    def mark_failed(self, worker: Worker) -> None:
        worker.failures += 1

    async def close(self) -> None:
        for worker in self.workers():
            if worker.channel is not None:
                await worker.channel.close(grace=None)
        for task in list(self._closing):
            task.cancel()


def same_tensor_parallel(prefill: Worker, decode: Worker) -> bool:
    """Whether `prefill`'s KV can move to `decode`: equal `--tensor-parallel-size`, or a worker
    that did not report its count (an older worker, or no poll answered yet)."""
    a = prefill.load.tensor_parallel_size if prefill.load is not None else 0
    b = decode.load.tensor_parallel_size if decode.load is not None else 0
    return a == b or not (a and b)


def queued_tokens(worker: Worker) -> int:
    """Prompt tokens waiting at a prefill worker: its last report, or what this router has
    sent it since (a burst lands before the next poll), whichever is more."""
    reported = worker.load.queued_prefill_tokens if worker.load is not None else 0
    return max(reported, worker.in_flight_tokens)


class RoutingPolicy:
    """Scores candidates; never blocks for long (Redis lookups have short timeouts), but with
    an index it does block (network I/O): the router calls it off its event loop then
    (`blocks`)."""

    def __init__(
        self,
        workers: WorkerSet,
        index: PrefixIndex | None,
        *,
        block_size: int,
        max_num_seqs: int = 64,
        weights: CostWeights | None = None,
        index_retry_s: float = 1.0,
        local_prefill: LocalPrefill | None = None,
    ) -> None:
        self.workers = workers
        self.local_prefill = local_prefill or DEFAULT_LOCAL_PREFILL
        self.stats = RouteStats()
        self.index = index
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.weights = weights or CostWeights()
        self.index_degraded = index is None
        self.index_retry_s = index_retry_s
        self._skip_index_until = 0.0
        self.lookups = 0
        self.lookup_errors = 0

    @property
    def blocks(self) -> bool:
        """True when `choose` may wait on Redis."""
        return self.index is not None

    def choose(
        self,
        block_hashes: Sequence[BlockHash],
        exclude: Sequence[str] = (),
        *,
        num_tokens: int | None = None,
    ) -> Decision:
        """The cheapest healthy pair. Raises LookupError when a role has no healthy worker.

        `num_tokens`: the prompt's length, for a request that the decode worker may prefill
        itself (one sample, no beam search); None: always a prefill worker."""
        prefills = [w for w in self.workers.workers(Role.PREFILL) if w.healthy]
        prefills = [w for w in prefills if w.worker_id not in exclude] or prefills
        decodes = [w for w in self.workers.workers(Role.DECODE) if w.healthy]
        if not prefills or not decodes:
            raise LookupError("no healthy prefill or decode worker")
        overlap = self._overlap(block_hashes)
        w = self.weights

        def prefill_cost(p: Worker) -> float:
            uncached = len(block_hashes) - overlap.get(p.worker_id, 0)
            queued = (p.load.queued_prefill_tokens if p.load else 0) / self.block_size
            return w.overlap * uncached + w.load * (queued + p.in_flight)

        def decode_held(d: Worker) -> float:
            return overlap.get(d.worker_id, 0) / len(block_hashes) if block_hashes else 0.0

        def decode_cost(d: Worker) -> float:
            load = d.load
            busy = (load.num_requests_running + load.num_requests_waiting) if load else 0
            usage = load.kv_cache_usage if load else 0.0
            return (
                w.decode * usage
                + w.queue * (busy + d.in_flight) / self.max_num_seqs
                - w.decode_overlap * decode_held(d)
            )

        decode = min(decodes, key=lambda d: (decode_cost(d), d.assigned))
        paired = [p for p in prefills if same_tensor_parallel(p, decode)]
        prefill = min(paired or prefills, key=lambda p: (prefill_cost(p), p.assigned))
        cached = overlap.get(prefill.worker_id, 0)
        decode_blocks = overlap.get(decode.worker_id, 0)
        here = self._prefill_here(prefill, decode, num_tokens)
        local = not here and self._locality(decode, decode_blocks, cached, num_tokens)
        if local:
            here = True
            self.stats.prefill_here_locality += 1
        if not paired and not here and self._can_prefill_here(decode, num_tokens):
            # NOTE: no prefill worker's KV fits this decode worker's ranks: the decode worker
            # would refuse the hand-off and recompute the prompt after a wasted prefill
            here = True
            self.stats.tensor_parallel_mismatch += 1
        if here:
            self.stats.prefill_here += 1
        else:
            self.stats.prefill_worker += 1
            prefill.assigned += 1
        decode.assigned += 1
        terms: dict[str, float | bool] = {
            "uncached_prefill_blocks": float(len(block_hashes) - cached),
            "prefill_cost": prefill_cost(prefill),
            "decode_cost": decode_cost(decode),
            "decode_cached_blocks": float(decode_blocks),
            "decode_overlap": w.decode_overlap * decode_held(decode),
            "index_degraded": self.index_degraded,
            "prefill_queue_tokens": float(queued_tokens(prefill)),
            "prefill_here": here,
            "prefill_here_locality": local,
            "tensor_parallel_paired": bool(paired),
        }
        return Decision(prefill, decode, cached, terms, prefill_here=here)

    def _prefill_here(self, prefill: Worker, decode: Worker, num_tokens: int | None) -> bool:
        """Conditional disaggregation (module docstring): a short prompt goes to the decode
        worker while the prefill worker has a queue."""
        local = self.local_prefill
        if not local.enabled or not self._can_prefill_here(decode, num_tokens):
            return False
        assert num_tokens is not None
        return num_tokens <= local.max_tokens and queued_tokens(prefill) >= local.queue_tokens

    def _locality(
        self, decode: Worker, decode_blocks: int, prefill_blocks: int, num_tokens: int | None
    ) -> bool:
        """Conditional disaggregation by locality (module docstring): the decode worker holds
        more leading blocks of the prompt than the prefill worker, and computes at most
        `max_suffix_tokens` of it itself."""
        limit = self.local_prefill.max_suffix_tokens
        if limit <= 0 or decode_blocks <= prefill_blocks:
            return False
        if not self._can_prefill_here(decode, num_tokens):
            return False
        assert num_tokens is not None
        return num_tokens - decode_blocks * self.block_size <= limit

    @staticmethod
    def _can_prefill_here(decode: Worker, num_tokens: int | None) -> bool:
        # NOTE: an older decode worker would take token 0 as the first
        load = decode.load
        return num_tokens is not None and load is not None and load.accepts_prefill_here

    def _overlap(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if self.index is None or not block_hashes:
            return {}
        if time.monotonic() < self._skip_index_until:
            return {}  # NOTE: degraded: no request waits on an index that just failed
        try:
            overlap = self.index.lookup(block_hashes)
        except IndexUnavailable:
            self.lookup_errors += 1
            self.index_degraded = True
            self._skip_index_until = time.monotonic() + self.index_retry_s
            return {}
        self.lookups += 1
        self.index_degraded = False
        return overlap
