"""Rank 0's end of a tensor-parallel worker's pipes (model/tp_ranks.py starts the ranks).

Before each step it runs, rank 0's runner sends every other rank a `RankStepMessage` over its
pipe (`Ranks.send`): the block copies and swap copies queued since the last step, then the
forward's inputs. Plain ints only, so it pickles small. A rank that is gone surfaces as
`RankLost` on rank 0, whose worker then stops stepping.

The model runner imports this module; the module that starts the rank processes imports the
runner (a rank process builds one), so the two halves live apart and neither imports the other
late.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.kvstore.transfer import ShmKVPool
from pagedserve.model.tensor_parallel import Group

START_TIMEOUT_S = 300.0  # a rank loads its shard of the weights before it says ready
STOP_TIMEOUT_S = 10.0


class RankLost(RuntimeError):
    """A tensor-parallel rank process is gone: the worker cannot step again (its loop dies,
    health turns NOT_SERVING). Not a failure of the step's requests."""


@dataclass(slots=True)
class RankStepMessage:
    """One step as every rank runs it: plain ints, so it pickles small (no tensor goes over
    the pipe: torch's multiprocessing pickler would share each through a new segment)."""

    copies: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    forward: bool = False  # False: only the copies (no forward this step)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # hidden rows to compute logits for
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    threads: int = 0  # torch threads per rank from now on (0: as before; `set_threads`)


class Ranks:
    """Rank 0's side: the other ranks' processes and pipes, and the group they share."""

    def __init__(
        self, processes: list[Any], pipes: list[Connection], group: Group, pools: list[ShmKVPool]
    ) -> None:
        self.processes, self.pipes, self.group = processes, pipes, group
        self.pools = pools  # ranks 1..N-1's KV caches, in shared memory rank 0 owns (CPU)
        self.pending: list[tuple[str, list[tuple[int, int]]]] = []
        self.threads = 0  # a new thread count per rank, for the next step (0: none)
        self.closed = False

    @property
    def size(self) -> int:
        """Ranks in the group, this one (rank 0) included."""
        return len(self.pipes) + 1

    @property
    def kv_caches(self) -> list[KVCache] | None:
        """Ranks 1..N-1's KV caches as rank 0 sees them (shared memory), or None where they
        are each rank's own device memory (CUDA)."""
        return [p.cache for p in self.pools] if self.pools else None

    def wait_ready(self) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            if not pipe.poll(START_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"tensor parallel rank {rank} did not start")
            kind, detail = pipe.recv()
            if kind != "ready":
                self.close()
                raise RuntimeError(f"tensor parallel rank {rank} failed to start: {detail}")

    def alive(self) -> bool:
        return not self.closed and all(p.is_alive() for p in self.processes)

    def check(self) -> None:
        """RankLost naming the first rank that is gone (exit code), if any."""
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                raise RankLost(f"tensor parallel rank {rank} exited (code {proc.exitcode})")
        if self.closed:
            raise RankLost("tensor parallel ranks were stopped")

    def copy(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        """Queue block copies (`copy`, `swap_in`, `swap_out`) for the next step's message."""
        if pairs:
            self.pending.append((kind, list(pairs)))

    def send(self, message: RankStepMessage) -> None:
        """Send every other rank this step (with the copies queued since the last)."""
        message.copies, self.pending = self.pending, []
        message.threads, self.threads = self.threads, 0
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(("step", message))
            except (BrokenPipeError, EOFError, OSError) as exc:
                raise RankLost(f"tensor parallel rank {rank} is gone: {exc}") from None

    def close(self) -> None:
        """Stop the other ranks (they exit when their pipe closes, too)."""
        if self.closed:
            return
        self.closed = True
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                pipe.send(("stop", None))
            pipe.close()
        for proc in self.processes:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
        for pool in self.pools:
            pool.close()
        self.pools = []
