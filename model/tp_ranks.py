"""The rank processes of a tensor-parallel worker (model/tensor_parallel.py has the sharding).

Rank 0 is the engine's own process: it schedules, owns the block tables and samples. It starts
ranks 1..N-1 (`start_ranks`, spawned processes), and before each step it runs it sends them the
step's `RankStepMessage` over a pipe (model/tp_pipes.py holds rank 0's end): the block copies and
swap copies issued since the last step, then the forward's inputs (token ids, positions, slots,
block tables, the rows to compute logits for). Every rank applies the copies to its own KV shard
and swap space, in order, then runs the same forward; the collectives inside it
(tensor_parallel.Group) line up because every rank runs the same message. The pipe, not a
collective, carries it, so an idle rank waits without a timeout, and a rank whose engine dies
sees the pipe close and exits.

A rank that dies makes the next collective on the others fail (gloo: the peer closed the
connection, or the group's timeout), so the step raises on rank 0 instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import torch

from pagedserve.kernels import dispatch
from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec
from pagedserve.kvstore.swap_space import SwapSpace
from pagedserve.kvstore.transfer import ShmKVPool
from pagedserve.model.config import ModelConfig
from pagedserve.model.loader import load_model
from pagedserve.model.runner import ModelRunner, kv_cache_spec
from pagedserve.model.tensor_parallel import Group, Shard, host_store, rank_device
from pagedserve.model.tp_pipes import Ranks, RankStepMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank process needs to build its part of the worker."""

    model_config: ModelConfig  # the whole model's (each rank takes its shard)
    num_blocks: int
    block_size: int
    num_swap_blocks: int
    device: str
    size: int
    port: int = 0  # rank 0's store (set by `start_ranks`)
    segments: tuple[str, ...] = ()  # ranks 1..N-1's KV pools in shared memory (CPU), by rank 0


def shard_model(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    return Shard.of(config, rank, size).config(config)


def _threads(size: int) -> int:
    """Torch threads per rank until rank 0's first step says otherwise: the cores shared out
    (`ModelRunner.set_threads`)."""
    return max(1, (os.cpu_count() or 1) // size)


def start_ranks(spec: RankSpec, pools: list[ShmKVPool]) -> Ranks:
    """Spawn ranks 1..size-1 and join the group as rank 0; `wait_ready` then waits until
    each holds its shard. `pools`: their KV caches (owned by the returned object)."""
    store = host_store(spec.size)
    spec = replace(spec, port=store.port)
    ctx = mp.get_context("spawn")
    processes, pipes = [], []
    for rank in range(1, spec.size):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=rank_main, args=(theirs, spec, rank), name=f"pagedserve-tp{rank}",
            daemon=True,
        )  # fmt: skip
        proc.start()
        theirs.close()
        processes.append(proc)
        pipes.append(ours)
    try:
        group = Group(0, spec.size, spec.port, store=store, device=spec.device)
    except BaseException:
        for proc in processes:
            proc.kill()
        raise
    return Ranks(processes, pipes, group, pools)


def start_runner(spec: RankSpec, *, kv_cache: KVCache | None = None) -> ModelRunner:
    """Rank 0's runner of a tensor-parallel worker, the other ranks started beside it: every
    rank loads its shard of the weights at the same time. On CPU the other ranks' KV caches
    are shared-memory segments rank 0 creates (so its transfers read and write every shard);
    `kv_cache`: rank 0's own, if the caller provides it (a prefill worker's shm pool)."""
    shard = shard_model(spec.model_config, 0, spec.size)  # ValueError naming the flag
    device = rank_device(spec.device, 0, spec.size)
    pools: list[ShmKVPool] = []
    if spec.device == "cpu":
        kv_spec = kv_cache_spec(shard, spec.block_size)
        pools = [ShmKVPool(kv_spec, spec.num_blocks) for _ in range(1, spec.size)]
    spec = replace(spec, segments=tuple(p.segment_name for p in pools))
    ranks = start_ranks(spec, pools)
    try:
        model = load_model(shard, device)
        model.join(ranks.group)
        ranks.wait_ready()
        return ModelRunner(shard, model, spec.num_blocks, spec.block_size, device,
                           kv_cache=kv_cache, ranks=ranks)  # fmt: skip
    except BaseException:
        ranks.close()
        raise


def rank_main(pipe: Connection, spec: RankSpec, rank: int) -> None:
    """A rank process: join the group, load this rank's shard, then run each step rank 0
    sends until it says stop or its pipe closes."""
    torch.set_num_threads(_threads(spec.size))
    try:
        group = Group(rank, spec.size, spec.port, device=spec.device)
        device = rank_device(spec.device, rank, spec.size)
        config = shard_model(spec.model_config, rank, spec.size)
        model = load_model(config, device)
        model.join(group)
        cache = _attach(kv_cache_spec(config, spec.block_size), spec, rank)
        runner = ModelRunner(config, model, spec.num_blocks, spec.block_size, device,
                             kv_cache=cache)  # fmt: skip
        swap = SwapSpace(runner.spec, spec.num_swap_blocks) if spec.num_swap_blocks else None
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", None))
    while True:
        try:
            kind, message = pipe.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if kind != "step":
            return
        try:
            _run(runner, swap, message)
        except Exception:  # noqa: BLE001 - the others see this rank leave the group
            log.error("tensor parallel rank %d failed:\n%s", rank, traceback.format_exc())
            os._exit(1)


def _attach(kv_spec: KVCacheSpec, spec: RankSpec, rank: int) -> KVCache | None:
    """This rank's KV cache in the segment rank 0 made for it (None: allocate our own)."""
    if not spec.segments:
        return None
    # NOTE: rank 0 owns and unlinks it; a spawned rank shares rank 0's resource tracker, where
    # the segment is registered once, so this rank neither unregisters nor unlinks it
    shm = shared_memory.SharedMemory(name=spec.segments[rank - 1])
    _segments.append(shm)
    size = kv_spec.bytes_per_block * spec.num_blocks
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)
    tensor = flat.view(kv_spec.storage_dtype).view(kv_spec.storage_shape(spec.num_blocks))
    return KVCache(kv_spec, spec.num_blocks, tensor=tensor)


_segments: list[shared_memory.SharedMemory] = []  # a rank process's mapped pool, kept open


def _run(runner: ModelRunner, swap: SwapSpace | None, message: RankStepMessage) -> None:
    if message.threads and message.threads != torch.get_num_threads():
        torch.set_num_threads(message.threads)
    cache = runner.kv_cache.tensor
    for kind, pairs in message.copies:
        if kind == "copy":
            dispatch.copy_blocks(cache, pairs)
            continue
        if swap is None:
            raise RuntimeError(f"tensor parallel rank: {kind} copies but no swap space")
        if kind == "swap_in":
            dispatch.swap_blocks(swap.tensor, cache, pairs)
        else:
            dispatch.swap_blocks(cache, swap.tensor, pairs)
    if not message.forward:
        return
    ints = lambda values: torch.tensor(values, dtype=torch.int64, device=runner.device)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=ints(message.slots), block_tables=ints(message.block_tables),
        query_lens=message.query_lens, seq_lens=message.seq_lens,
    )  # fmt: skip
    hidden = runner.model(ints(message.token_ids), ints(message.positions), runner.kv_cache, meta)
    if message.logit_rows:
        runner.model.compute_logits(hidden[ints(message.logit_rows)])
