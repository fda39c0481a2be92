"""`Swapper`: copies KV blocks between the device `KVCache` and the `SwapSpace`, asynchronously.

Each step's swaps are one job on one FIFO queue: a copy thread on CPU, a separate CUDA stream on
GPU. The scheduler frees a swapped-out block's device id at once (the step that preempted a
victim needs its blocks now), so the bytes may still be in flight when the id is reused. Three
rules keep every read and write ordered; the engine applies the last two:

1. **FIFO, in decision order.** Jobs run in submission order; inside a job, copies run in the
   order the scheduler decided them (`DecodePlan.swaps`). So every block id freed by one decision
   and reused by a later one, in this step or a later step, is read before it is written: a
   host block freed by a swap-in and reused by a later swap-out, a swap-out's host block read
   by a later swap-in, and a victim's device block swapped out and then filled by a swap-in
   (a swapped sequence displacing a running one in the same step).
2. **Swap-ins land before the forward.** `wait_swap_in()` before the step's forward.
3. **Swap-out sources are not overwritten before they are copied.** Before a step writes any
   device block (copy-on-write destinations, its new tokens' slots), the engine calls
   `wait_for_writes(blocks)`, which waits for every pending swap-out reading one of them. We
   chose this over holding freed ids back in the scheduler: the step that preempts still gets
   the blocks at once, and a swap-out overlaps the next forward whenever the pool hands out
   other blocks first (the free list is FIFO, so a just-freed block is reused last).

On CUDA the swap stream first waits for the compute stream (the copied blocks were written by
earlier forwards) and the waits above are stream waits on events; the host never blocks. On CPU
the waits block the calling thread on the job's future. A copy that raises re-raises in the
waiter; nothing is swallowed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pagedserve.core_share import one_torch_thread
from pagedserve.decode_worker.plan import SwapCopies, SwapDirection
from pagedserve.kernels import dispatch
from pagedserve.kvstore.block_pool import BlockId

Pairs = Seq[tuple[int, int]]
CopyFn = Callable[[torch.Tensor, torch.Tensor, Pairs], None]


def _dispatch_swap(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs) -> None:
    dispatch.swap_blocks(src, dst, list(pairs))


def every_rank(
    device_caches: Seq[torch.Tensor], host_caches: Seq[torch.Tensor], copy_fn: CopyFn | None = None
) -> CopyFn:
    """A copy function that applies each copy the Swapper makes between rank 0's device and
    host caches (the first of each list) to every tensor-parallel rank's pair, in rank order:
    so one job, and one `wait_for_writes`, covers every rank's shard (model/tp_ranks.py)."""
    copy = copy_fn or _dispatch_swap

    def copy_all(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs) -> None:
        out = src is device_caches[0]
        for device, host in zip(device_caches, host_caches, strict=True):
            copy(*((device, host) if out else (host, device)), pairs)

    return copy_all


@dataclass(slots=True)
class SwapperStats:
    """Cumulative; `busy_seconds` is time spent copying (the measured swap bandwidth's basis)."""

    num_jobs: int = 0
    num_blocks_in: int = 0
    num_blocks_out: int = 0
    num_bytes_in: int = 0
    num_bytes_out: int = 0
    busy_seconds: float = 0.0
    num_waits_for_swap_out: int = 0  # steps that had to wait before overwriting a swapped block


@dataclass(slots=True, eq=False)
class _Job:
    sources: frozenset[int]  # device blocks its swap-outs read
    num_in: int
    num_out: int
    future: Future[None] | None = None  # CPU
    start: torch.cuda.Event | None = None  # CUDA
    end: torch.cuda.Event | None = None

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.end is None or bool(self.end.query())


class Swapper:
    """Executes `DecodePlan.swaps` between `device_cache` and `host_cache`, in plan order.

    Both tensors are block-major pages with equal block shapes (`KVCache.tensor`,
    `SwapSpace.tensor`); block ids index dim 0. `copy_fn` replaces the copy (tests slow it down
    to prove the ordering); the default is `kernels.dispatch.swap_blocks` (one copy per run of
    consecutive ids, asynchronous between a GPU and pinned memory). Call `close()` when done.
    """

    def __init__(
        self, device_cache: torch.Tensor, host_cache: torch.Tensor, *, copy_fn: CopyFn | None = None
    ) -> None:
        if device_cache.shape[1:] != host_cache.shape[1:] or device_cache.dtype != host_cache.dtype:
            raise ValueError(
                f"host_cache: block shape {tuple(host_cache.shape[1:])} {host_cache.dtype} does "
                f"not match the device's {tuple(device_cache.shape[1:])} {device_cache.dtype}"
            )
        self.device_cache = device_cache
        self.host_cache = host_cache
        self.copy_fn = copy_fn or _dispatch_swap
        self.bytes_per_block = device_cache[0].numel() * device_cache.element_size()
        self.stats = SwapperStats()
        self._lock = threading.Lock()
        self._pending: list[_Job] = []
        self._cuda = device_cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(device_cache.device) if self._cuda else None
        self._executor = (
            None
            if self._cuda
            else ThreadPoolExecutor(1, "pagedserve-swapper", initializer=one_torch_thread)
        )

    @property
    def num_pending(self) -> int:
        self._prune()
        return len(self._pending)

    def submit(self, swap_in: Pairs, swap_out: Pairs) -> None:
        """Queue one job: `swap_in` (host, device) pairs, then `swap_out` (device, host) pairs."""
        self.submit_plan(
            [
                SwapCopies(SwapDirection.IN, [(BlockId(a), BlockId(b)) for a, b in swap_in]),
                SwapCopies(SwapDirection.OUT, [(BlockId(a), BlockId(b)) for a, b in swap_out]),
            ]
        )

    def submit_plan(self, swaps: Seq[SwapCopies]) -> None:
        """Queue one step's copies (`DecodePlan.swaps`) as one job that runs them in the given
        order. Returns at once; see the module docstring for what to wait on."""
        runs = [SwapCopies(c.direction, list(c.pairs)) for c in swaps if c.pairs]
        if not runs:
            return
        outs = [c.pairs for c in runs if c.direction is SwapDirection.OUT]
        job = _Job(
            frozenset(d for pairs in outs for d, _ in pairs),
            sum(len(c.pairs) for c in runs if c.direction is SwapDirection.IN),
            sum(map(len, outs)),
        )
        if self._executor is not None:
            job.future = self._executor.submit(self._run, runs, job)
        else:
            job.start, job.end = self._launch_cuda(runs)
        self.stats.num_jobs += 1
        self._pending.append(job)

    def wait_swap_in(self) -> None:
        """Make the next forward wait until every submitted swap-in has landed."""
        jobs = [job for job in self._pending if job.num_in]
        if jobs:
            self._wait(jobs[-1])

    def wait_for_writes(self, block_ids: Iterable[int]) -> bool:
        """Make the caller's next writes to `block_ids` wait for pending swap-outs reading them.

        Returns whether a wait was needed (so tests and metrics can see the overlap).
        """
        self._prune()
        blocks = set(block_ids)
        hits = [job for job in self._pending if job.sources & blocks]
        if not hits:
            return False
        self.stats.num_waits_for_swap_out += 1
        self._wait(hits[-1])  # FIFO: the last one done means every earlier one is done
        return True

    def synchronize(self) -> None:
        """Wait for every pending copy (host-blocking on both devices)."""
        for job in self._pending:
            if job.future is not None:
                job.future.result()
            elif job.end is not None:
                job.end.synchronize()
        self._prune()

    def close(self) -> None:
        self.synchronize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -- internals -----------------------------------------------------------------------------

    def _run(self, runs: list[SwapCopies], job: _Job) -> None:
        start = time.perf_counter()
        for run in runs:
            self._copy(run)
        self._account(job.num_in, job.num_out, time.perf_counter() - start)

    def _copy(self, run: SwapCopies) -> None:
        if run.direction is SwapDirection.IN:
            self.copy_fn(self.host_cache, self.device_cache, run.pairs)
        else:
            self.copy_fn(self.device_cache, self.host_cache, run.pairs)

    def _launch_cuda(self, runs: list[SwapCopies]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        stream = self._stream
        assert stream is not None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device_cache.device))
        with torch.cuda.stream(stream):
            start.record(stream)
            for run in runs:
                self._copy(run)
            end.record(stream)
        # NOTE: counted when the job is pruned (elapsed_time needs both events done).
        return start, end

    def _account(self, num_in: int, num_out: int, seconds: float) -> None:
        with self._lock:
            self.stats.num_blocks_in += num_in
            self.stats.num_blocks_out += num_out
            self.stats.num_bytes_in += num_in * self.bytes_per_block
            self.stats.num_bytes_out += num_out * self.bytes_per_block
            self.stats.busy_seconds += seconds

    def _wait(self, job: _Job) -> None:
        if job.future is not None:
            job.future.result()
        elif job.end is not None:
            torch.cuda.current_stream(self.device_cache.device).wait_event(job.end)

    def _prune(self) -> None:
        done = [job for job in self._pending if job.done()]
        for job in done:
            if job.future is not None:
                job.future.result()  # re-raise a failed copy here rather than lose it
            elif job.start is not None and job.end is not None:
                seconds = job.start.elapsed_time(job.end) / 1000
                self._account(job.num_in, job.num_out, seconds)
        self._pending = [job for job in self._pending if job not in done]
