"""`CoreShare`: the model workers of one host lend each other their cores.

`pagedserve up` on one host starts a prefill and a decode worker that each used to get a fixed
half of the cores. Their load is not even: in a burst both compute, but once the prompts are in,
the prefill worker sleeps and the decode worker still has every decode step to run on its half
(measured on 2 cores, SmolLM2, 48 requests at once: the prefill worker idle for the last 32 of
48 s while the decode worker used one core of two).

So the workers share a small file (one slot per worker: its pid and whether it has work). Before
each step a worker marks itself busy and takes `cores // busy workers` threads; a worker waiting
for work marks itself idle. A worker that died busy counts as idle (its pid is gone). A prefill
worker never borrows (`borrow=False`: at most `cores // workers`): its steps last seconds, and
one that started on every core while the decode worker was idle ran 1.5x slower once the decode
worker woke beside it (7.0 s for 2,048 tokens on 2 + 1 threads, 4.5 s on 1 + 1)::

    slot i:  | pid (int64) | busy (int64) |        busy workers = slots busy with a live pid

NOTE: torch's intra-op thread count is per calling thread (OpenMP's nthreads ICV), so a worker
must call `busy()` from the thread that runs its forwards. Thread count changes only when the
number of busy workers does; when it does, a step already running elsewhere keeps its threads
until it ends (a short overlap, measured in docs/benchmarks).

NOTE: torch is imported inside the two functions that call it, not at the top: `pagedserve up`
(the launcher) creates the share file and must start without torch's import cost.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

_SLOT = struct.Struct("<qq")


def create(path: Path, num_slots: int) -> None:
    """A share file for `num_slots` workers, every slot idle (the launcher calls this)."""
    path.write_bytes(bytes(_SLOT.size * num_slots))


def parse_spec(spec: str) -> tuple[Path, int]:
    """`PATH:SLOT` (the workers' `--core-share` flag) -> (path, slot); ValueError naming it."""
    path, sep, slot = spec.rpartition(":")
    if not sep or not path or not slot.isdigit():
        raise ValueError(f"core-share: expected PATH:SLOT, got {spec!r}")
    return Path(path), int(slot)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CoreShare:
    """One worker's view of the share file."""

    def __init__(
        self,
        path: Path,
        slot: int,
        *,
        cores: int | None = None,
        set_threads: Callable[[int], None] | None = None,
        borrow: bool = True,
    ) -> None:
        """`borrow`: take more than `cores // slots` threads while others are idle (a worker
        whose steps are short enough to give them back soon)."""
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.num_slots = len(self._map) // _SLOT.size
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"core-share: slot {slot} is not in [0, {self.num_slots})")
        self.slot = slot
        self.cores = cores or len(os.sched_getaffinity(0))
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self.borrow = borrow
        self._pid = os.getpid()
        self._busy = False
        self.threads = 0  # NOTE: what this worker set last (0: not yet)
        self._write(False)

    def _write(self, busy: bool) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, self._pid, int(busy))
        self._busy = busy

    def busy_workers(self) -> int:
        """Workers with work now (this one included when it is busy)."""
        count = 0
        for i in range(self.num_slots):
            pid, busy = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if busy and (i == self.slot or _alive(pid)):
                count += 1
        return count

    def busy(self) -> int:
        """Before a step: mark this worker busy and take its share of the cores (the count)."""
        if not self._busy:
            self._write(True)
        threads = max(1, self.cores // max(1, self.busy_workers()))
        if not self.borrow:
            threads = min(threads, max(1, self.cores // self.num_slots))
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        return threads

    def idle(self) -> None:
        """No work: the other workers may take this one's cores."""
        if self._busy:
            self._write(False)

    def close(self) -> None:
        self.idle()
        self._map.close()


def one_torch_thread() -> None:
    """Make this (side) thread compute with one torch thread: a thread initializer.

    NOTE: only the engine loop's thread may enter OpenMP parallel regions with several threads.
    Every other thread that does (a KV import, a swap, a PullKv read) gets its own OpenMP team,
    and once the process has more OpenMP threads than cores libgomp stops spinning between
    regions: the engine's steps ran 1.8x slower (pagedserve/grpcutil.py, `EngineLoop`). torch
    keeps the count per thread (and MKL's with `mkl_set_num_threads_local`), so the engine
    loop's threads are untouched.
    """
    import torch

    torch.set_num_threads(1)


def open_core_share(
    spec: str | None, *, borrow: bool = True, set_threads: Callable[[int], None] | None = None
) -> CoreShare | None:
    """A worker's `--core-share PATH:SLOT` (None: no sharing, the thread count stays).
    `set_threads`: how the worker applies its share (`ModelRunner.set_threads`, which splits
    it between tensor-parallel ranks); default `torch.set_num_threads`."""
    if spec is None:
        return None
    return CoreShare(*parse_spec(spec), borrow=borrow, set_threads=set_threads)
