"""Tensor parallelism (Megatron-style) inside one worker: `--tensor-parallel-size N` runs the
model on N rank processes, each holding a shard of every weight and of the KV cache.

Sharding of a Llama-family decoder over `size` ranks (rank r):

    q_proj          rows: query heads [r H/N, (r+1) H/N)                column-parallel
    k_proj, v_proj  rows: KV heads [r K/N, (r+1) K/N); with fewer KV heads than ranks
                    (K < N) rank r holds the one head r K / N (replicated, as vLLM does)
    o_proj          columns of rank r's query heads; one all-reduce      row-parallel
    gate, up        rows: intermediate features [r I/N, (r+1) I/N)      column-parallel
    down            columns of the same features; one all-reduce        row-parallel
    embed_tokens    rows: the vocabulary [r V/N, (r+1) V/N); lookups outside it are 0,
                    then one all-reduce                                  vocab-parallel
    lm_head         rows: the same vocabulary slice; logits gathered to rank 0, which samples
    norms           replicated

A row-parallel layer's bias is added once (rank 0's copy; the others hold zeros). Each rank's
KV cache holds its KV heads for every block; block ids are the same on every rank (one
allocator, on rank 0), so block hashes, leases and the scheduler do not change.

The ranks talk through a gloo process group built from its own TCP store on loopback (no
global `torch.distributed` state: several engines may live in one process, as tests do); on
CUDA the same collectives would take NCCL. Rank 0 is the engine; it sends every other rank
each step's `RankStepMessage` over a pipe (model/tp_pipes.py) before running the step itself, so
every rank enters the same collectives in the same order.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pagedserve.model.config import ModelConfig

ROW_PARALLEL = ("o_proj", "down_proj")
TIMEOUT = datetime.timedelta(seconds=60)  # one collective; a dead rank fails the step
START = datetime.timedelta(seconds=300)  # every rank joins the group (spawn, imports, a busy host)


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`, and the model dimensions it splits."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> Shard:
        """Raises ValueError naming `tensor_parallel_size` when the model does not split."""
        heads, kv = config.num_heads, config.num_kv_heads
        why = None
        if size < 1:
            why = "must be at least 1"
        elif heads % size:
            why = f"does not divide the model's {heads} attention heads"
        elif kv % size and size % kv:
            why = f"neither divides nor is a multiple of the model's {kv} KV heads"
        elif config.intermediate_size % size:
            why = f"does not divide the MLP's {config.intermediate_size} features"
        elif config.vocab_size % size:
            why = f"does not divide the vocabulary of {config.vocab_size} tokens"
        elif size > 1 and config.qk_norm == "projection":
            # NOTE: the norm's mean runs over every head; a rank holds only its own (OLMo 2)
            why = "needs 1: the q/k norms span every head (OLMo 2)"
        if why is not None:
            raise ValueError(f"tensor_parallel_size: {size} {why}")
        return cls(rank, size, heads, kv, config.head_dim, config.intermediate_size,
                   config.vocab_size)  # fmt: skip

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank * self.num_kv_heads // self.size

    @property
    def vocab(self) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary slice."""
        per = self.vocab_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def config(self, config: ModelConfig) -> ModelConfig:
        """The model as this rank builds it: its heads, KV heads, MLP features and vocabulary
        slice (token ids stay global: the engine validates them against the whole config)."""
        return replace(
            config,
            num_heads=self.local_heads,
            num_kv_heads=self.local_kv_heads,
            intermediate_size=self.intermediate_size // self.size,
            vocab_size=self.vocab_size // self.size,
            tp=self,
        )

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (whole for the norms)."""
        d, per_i = self.head_dim, self.intermediate_size // self.size
        rows = None
        if ".q_proj." in name:
            rows = (self.rank * self.local_heads * d, self.local_heads * d)
        elif ".k_proj." in name or ".v_proj." in name:
            rows = (self.first_kv_head * d, self.local_kv_heads * d)
        elif ".gate_proj." in name or ".up_proj." in name:
            rows = (self.rank * per_i, per_i)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab
            rows = (start, end - start)
        if rows is not None:
            return tensor.narrow(0, *rows)
        if name.endswith(tuple(f"{p}.bias" for p in ROW_PARALLEL)):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith("o_proj.weight"):
            return tensor.narrow(1, self.rank * self.local_heads * d, self.local_heads * d)
        if name.endswith("down_proj.weight"):
            return tensor.narrow(1, self.rank * per_i, per_i)
        return tensor


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`.port`), made before the other
    ranks start so that they know where it is; it waits `START` for them to join."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=START, wait_for_workers=False)


def rank_device(device: str, rank: int, size: int) -> str:
    """Where rank `rank` computes: with a CUDA device per rank, cuda:rank (NCCL between them);
    otherwise every rank on `device` (CPU, or one GPU shared, gloo between them)."""
    if device.startswith("cuda") and nccl_usable(device, size):
        return f"cuda:{rank}"
    return device


def nccl_usable(device: str, size: int) -> bool:
    return (
        device.startswith("cuda")
        and dist.is_nccl_available()
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= size
    )


class Group:
    """The collectives of one worker's ranks over the TCP store rank 0 hosts (`host_store`);
    the other ranks join it at `port`. NCCL where every rank has its own GPU; gloo otherwise
    (CPU, or ranks sharing one GPU: tensors go through host memory). Each collective times out
    after `timeout` (a dead rank fails the step)."""

    def __init__(
        self,
        rank: int,
        size: int,
        port: int,
        timeout: datetime.timedelta = TIMEOUT,
        store: dist.TCPStore | None = None,
        device: str = "cpu",
    ):
        self.rank, self.size = rank, size
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, False, timeout=START)
        self.nccl = nccl_usable(device, size)
        # NOTE: the stubs lack the process groups' collectives (`Any`)
        self.pg: Any
        if self.nccl:
            torch.cuda.set_device(rank)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = START
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, START)
        # NOTE: joining may take minutes on a busy host (spawn, imports); a collective may not
        self.pg.set_timeout(timeout)

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """What gloo reduces: a host copy for a device tensor, fp32 for bf16 / fp16 (gloo sums
        in the tensor's dtype); NCCL takes the tensor itself."""
        if self.nccl:
            return tensor
        if tensor.dtype in (torch.float16, torch.bfloat16):
            return tensor.to("cpu", torch.float32)
        return tensor.cpu()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        staged = self._staged(tensor)
        self.pg.allreduce([staged]).wait()
        return tensor if staged is tensor else tensor.copy_(staged)

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along the last dimension, on rank 0 (None on the
        others)."""
        staged = self._staged(tensor.contiguous()).contiguous()
        outputs = [[torch.empty_like(staged) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(outputs, [staged], dist.GatherOptions()).wait()
        if self.rank != 0:
            return None
        return torch.cat(outputs[0], dim=-1).to(tensor.device, tensor.dtype)
