"""Shared steps of the KV-tier tests (host tier, disk tier): filling cached blocks with known
KV, and running waves of requests through a decode engine under pressure."""

from __future__ import annotations

from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.kvstore.kv_offload import KVOffload


def fill(manager: KVCacheManager, offload: KVOffload, hashes, value: float) -> None:
    """A table over len(hashes) full blocks whose KV is `value + i`, cached, then freed."""
    table = BlockTable(manager.pool)
    manager.allocate(table, len(hashes) * manager.pool.block_size)
    for i, block_id in enumerate(table.block_ids):
        offload.device_tensor[block_id] = value + i
    manager.cache_full_blocks(table, hashes, table.num_tokens)
    manager.free(table)


def run_waves(engine, waves, params):
    """Each wave's prompts added, then stepped to the end with integrity checked after every
    step; returns (sequences in prompt order, how many preemptions the plans made)."""
    seqs, preempted = [], 0
    for wave in waves:
        seqs += [engine.add_request(p, params) for p in wave]
        while engine.has_unfinished:
            preempted += len(engine.step().plan.preempted)
            engine.check_integrity()
    engine.close()
    return seqs, preempted
