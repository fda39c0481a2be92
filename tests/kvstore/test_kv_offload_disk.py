"""KVOffload with a disk tier: host slots the host tier reuses are spilled to disk, and a
prefix match promotes the host run and then the disk run (bytes, hashes and depths kept);
a hash the device registers again leaves the disk; a reset empties it."""

from __future__ import annotations

import pytest
import torch
from support.tiers import fill

from pagedserve.kvstore.block_pool import BlockPool
from pagedserve.kvstore.block_table import BlockTable
from pagedserve.kvstore.disk_tier import DiskTier
from pagedserve.kvstore.kv_cache import KVCacheSpec
from pagedserve.kvstore.kv_cache_manager import KVCacheManager
from pagedserve.kvstore.kv_offload import KVOffload

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)


def h(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8  # a 16-byte stand-in for a BlockHash


def make_manager(tmp_path, num_blocks: int, num_slots: int, spec: KVCacheSpec = SPEC):
    pool = BlockPool(num_blocks, spec.block_size)
    device = torch.zeros(spec.storage_shape(num_blocks), dtype=spec.storage_dtype)
    disk = DiskTier(tmp_path, 1 << 16, bytes_per_block=spec.bytes_per_block, compat_key=h(99))
    offload = KVOffload(spec, device, num_slots, disk=disk)
    return KVCacheManager(pool, offload=offload), offload


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_prefix_comes_back_from_the_host_run_then_the_disk_run_with_its_bytes(tmp_path, dtype):
    """int8: an 8-bit cache's raw uint8 pages (codes and scales) move as they are."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype=dtype)
    manager, offload = make_manager(tmp_path, num_blocks=4, num_slots=2, spec=spec)
    prefix = [h(0), h(1), h(2), h(3)]
    fill(manager, offload, prefix, 10.0)
    fill(manager, offload, [h(10), h(11), h(12), h(13)], 20.0)  # 2 to host, 2 on to disk
    assert [x in offload.tier for x in prefix] == [True, True, False, False]
    assert [x in offload.disk for x in prefix] == [False, False, True, True]
    manager.check_integrity()
    matched = manager.match_prefix(prefix)
    assert [manager.pool.block_hash(b) for b in matched] == prefix
    for i, block_id in enumerate(matched):
        assert torch.all(offload.device_tensor[block_id] == 10.0 + i)
    counts = offload.counts()
    assert counts.promotions == 2 and counts.disk_promotions == 2
    assert counts.disk_promotion_bytes == 2 * spec.bytes_per_block
    assert not any(x in offload.disk or x in offload.tier for x in prefix)
    manager.check_integrity()
    offload.close()


def test_a_hash_registered_again_on_the_device_leaves_the_disk(tmp_path):
    manager, offload = make_manager(tmp_path, num_blocks=1, num_slots=1)
    for i in range(3):
        fill(manager, offload, [h(i)], float(i))
    assert h(0) in offload.disk
    fill(manager, offload, [h(0)], 0.0)  # recomputed without a match
    assert h(0) not in offload.disk
    manager.check_integrity()
    manager.pool.reset_prefix_cache()
    assert offload.disk.num_blocks == 0
    manager.check_integrity()
    offload.close()


def test_a_device_short_of_blocks_promotes_a_shorter_disk_run(tmp_path):
    manager, offload = make_manager(tmp_path, num_blocks=3, num_slots=1)
    fill(manager, offload, [h(0), h(1), h(2)], 10.0)
    fill(manager, offload, [h(5), h(6), h(7)], 50.0)  # h(0..2) go to host, then disk
    assert sum(x in offload.disk for x in (h(0), h(1), h(2))) >= 2
    table = BlockTable(manager.pool)
    manager.allocate(table, 2 * SPEC.block_size)  # two blocks held: one left for promotion
    matched = manager.match_prefix([h(0), h(1), h(2)])
    assert len(matched) == 1 and torch.all(offload.device_tensor[matched[0]] == 10.0)
    manager.check_integrity()
    manager.free(table)
    offload.close()
