"""The model and KV pool a worker's flags size, one function for the prefill and the decode worker.

    --model --dtype --quantization --kv-cache-dtype  ──► ModelConfig (load_model_config)
    --tensor-parallel-size                            ──► rank 0's shard of it
    --kv-cache-memory[-fraction] --device             ──► rank 0's KV budget (rank_kv_cache_bytes)
    --num-gpu-blocks-override, else budget / block    ──► num_blocks (per rank, one allocator)
    --kv-offload-memory / block                       ──► kv_offload_blocks (host prefix tier)
    --kv-offload-dir, --kv-offload-disk               ──► kv_offload_dir, _disk_bytes (disk tier)

Each worker's server builds its engine's config from `EngineSizing.fields` (the fields both
engine configs share) plus its own flags, so the two workers size a pool alike.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TypedDict

from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.model.config import ModelConfig, load_model_config
from pagedserve.model.quant import WeightQuant, weight_quant_from_args
from pagedserve.model.runner import kv_cache_spec, rank_kv_cache_bytes
from pagedserve.model.tp_ranks import shard_model


class EngineFields(TypedDict):
    """The fields `PrefillEngineConfig` and `DecodeEngineConfig` share, as the flags set them."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int | None
    enable_prefix_caching: bool
    eviction_policy: EvictionPolicy
    kv_offload_blocks: int
    kv_offload_dir: str | None
    kv_offload_disk_bytes: int
    dtype: str | None
    quantization: WeightQuant | None
    kv_cache_dtype: str | None
    device: str
    tensor_parallel_size: int


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """A worker's model (its config as the flags load it) and its KV pool."""

    model_config: ModelConfig
    bytes_per_block: int  # one block of one rank's shard
    fields: EngineFields

    @property
    def kv_pool_bytes(self) -> int:
        """One rank's KV pool."""
        return self.fields["num_blocks"] * self.bytes_per_block


def size_engine(args: argparse.Namespace, extra_bytes_per_block: int = 0) -> EngineSizing:
    """Load the model's config and size the KV pool from a worker's flags
    (cli_options.add_model_arguments); ValueError naming the flag if they do not fit.
    `extra_bytes_per_block`: more KV each block holds beside the model's (a draft model's,
    model/draft.py), taken from the same budget."""
    quantization = weight_quant_from_args(args)
    model_config = load_model_config(args.model, args.dtype, quantization, args.kv_cache_dtype)
    ranks = args.tensor_parallel_size
    rank_config = shard_model(model_config, 0, ranks) if ranks > 1 else model_config
    spec = kv_cache_spec(rank_config, args.block_size)
    memory = rank_kv_cache_bytes(rank_config, args, ranks)
    per_block = spec.bytes_per_block + extra_bytes_per_block
    num_blocks = args.num_gpu_blocks_override or max(0, memory // per_block)
    if num_blocks < 1:
        raise ValueError("kv-cache-memory: too small for one block")
    fields = EngineFields(
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        eviction_policy=EvictionPolicy(args.eviction_policy),
        kv_offload_blocks=spec.num_blocks_for(getattr(args, "kv_offload_memory", 0)),
        kv_offload_dir=getattr(args, "kv_offload_dir", None),
        kv_offload_disk_bytes=getattr(args, "kv_offload_disk", 0),
        dtype=args.dtype,
        quantization=quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        tensor_parallel_size=ranks,
    )
    return EngineSizing(model_config, spec.bytes_per_block, fields)
