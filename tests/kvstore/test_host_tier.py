"""The prefix cache's host tier: HostTier's slot bookkeeping, the pool's eviction hook, and
KVCacheManager promoting host-held blocks back (bytes copied, hashes and depths kept)."""

from __future__ import annotations

import pytest
import torch
from support.tiers import fill

from pagedserve.decode_worker.engine import DecodeEngineConfig
from pagedserve.kvstore.block_pool import BlockEvent, BlockEventKind, BlockPool
from pagedserve.kvstore.eviction import EvictionPolicy
from pagedserve.kvstore.host_tier import OFFLOAD_GAUGES, HostTier
from pagedserve.kvstore.kv_cache import KVCacheSpec
from pagedserve.kvstore.kv_cache_manager import KVCacheManager, offload_counts
from pagedserve.kvstore.kv_offload import KVOffload, make_offload
from pagedserve.metrics import CounterSource, StateCollector
from pagedserve.prefill_worker.engine import PrefillEngineConfig

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)


def h(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8  # a 16-byte stand-in for a BlockHash


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_full_tier_reuses_the_oldest_slot_and_keeps_counts(policy):
    tier = HostTier(3, eviction_policy=policy)
    slots = [tier.store(h(i), depth=i) for i in range(3)]
    assert sorted(slots) == [0, 1, 2] and tier.num_free == 0 and tier.num_cached == 3
    assert tier.store(h(1)) is None, "a hash already held is not stored twice"
    reused = tier.store(h(3))
    assert reused == slots[0] and h(0) not in tier and tier.lookup(h(3)) == reused
    assert tier.stats.writes == 4 and tier.stats.evictions == 1
    tier.check_integrity()


def test_take_and_discard_free_slots_and_clear_empties_the_tier():
    tier = HostTier(4)
    for i in range(3):
        tier.store(h(i))
    tier.pin(h(1))
    slot = tier.take(h(1))
    assert tier.discard(h(2)) and not tier.discard(h(2))
    assert tier.num_free == 3 and tier.num_cached == 1 and tier.stats.promotions == 1
    assert tier.store(h(9)) != slot, "free slots are reused oldest-freed first"
    tier.check_integrity()
    assert tier.clear() == 2 and tier.num_free == 4
    tier.check_integrity()
    with pytest.raises(KeyError):
        tier.take(h(0))


def test_pinned_slots_are_never_evicted_nor_discarded():
    tier = HostTier(2)
    tier.store(h(0))
    tier.store(h(1))
    tier.pin(h(0))
    assert not tier.discard(h(0))
    assert tier.store(h(2)) is not None and h(0) in tier and h(1) not in tier
    tier.pin(h(2))
    assert tier.store(h(3)) is None and tier.stats.dropped == 1, "every slot pinned: skipped"
    tier.check_integrity()
    tier.unpin(h(2))
    assert tier.store(h(4)) is not None and h(2) not in tier
    tier.check_integrity()


def test_integrity_names_a_slot_in_two_states():
    tier = HostTier(2)
    tier.store(h(0))
    tier._free.append(tier.lookup(h(0)))  # corrupt on purpose
    with pytest.raises(RuntimeError, match="integrity"):
        tier.check_integrity()


class Recorder:
    def __init__(self, pool: BlockPool):
        self.pool, self.calls = pool, []

    def evicted(self, block_id, block_hash, depth):
        # NOTE: called while the block still carries its hash (its KV is intact)
        assert self.pool.block_hash(block_id) == block_hash
        self.calls.append(("evicted", block_id, block_hash, depth))
        return False  # not kept: the pool records REMOVED

    def attach(self, sink):
        self.calls.append(("attach",))

    def stored(self, block_hash):
        self.calls.append(("stored", block_hash))

    def reset(self):
        self.calls.append(("reset",))


def test_pool_reports_evictions_with_depth_before_dropping_the_hash():
    pool = BlockPool(2, 2)
    rec = Recorder(pool)
    pool.set_tier(rec)
    ids = pool.allocate(2)
    pool.cache_block(ids[0], h(0), depth=0)
    pool.cache_block(ids[1], h(1), depth=1)
    pool.free(reversed(ids))
    pool.allocate(1)
    assert rec.calls == [
        ("attach",), ("stored", h(0)), ("stored", h(1)), ("evicted", ids[1], h(1), 1)
    ]  # fmt: skip
    assert pool.drain_events()[-1] == BlockEvent(BlockEventKind.REMOVED, h(1))
    pool.reset_prefix_cache()
    assert rec.calls[-1] == ("reset",)
    pool.check_integrity()


def make_manager(num_blocks: int, num_slots: int) -> tuple[KVCacheManager, KVOffload]:
    pool = BlockPool(num_blocks, SPEC.block_size)
    device = torch.zeros(SPEC.storage_shape(num_blocks))
    offload = KVOffload(SPEC, device, num_slots)
    return KVCacheManager(pool, offload=offload), offload


def test_evicted_prefix_is_promoted_back_with_its_bytes():
    manager, offload = make_manager(num_blocks=3, num_slots=4)
    prefix = [h(0), h(1), h(2)]
    fill(manager, offload, prefix, 10.0)
    fill(manager, offload, [h(7), h(8), h(9)], 20.0)  # evicts the whole prefix to the host
    assert all(x in offload.tier for x in prefix) and manager.pool.lookup(h(0)) is None
    assert offload.counts().writes == 3
    manager.check_integrity()
    matched = manager.match_prefix(prefix)
    assert len(matched) == 3
    for i, block_id in enumerate(matched):
        assert manager.pool.block_hash(block_id) == prefix[i]
        assert torch.all(offload.device_tensor[block_id] == 10.0 + i)
    counts = offload.counts()
    assert counts.hits == 3 and counts.promotions == 3
    assert counts.promotion_bytes == 3 * SPEC.bytes_per_block
    assert not any(x in offload.tier for x in prefix), "promotion moves a block, not copies it"
    manager.check_integrity()


def test_promotion_keeps_the_device_run_and_stops_where_the_host_run_stops():
    manager, offload = make_manager(num_blocks=3, num_slots=1)
    fill(manager, offload, [h(0), h(1), h(2)], 10.0)
    fill(manager, offload, [h(5)], 30.0)  # evicts h(2) (the leaf) into the one slot
    fill(manager, offload, [h(6)], 40.0)  # evicts h(1); h(2) is dropped from the full tier
    assert h(1) in offload.tier and h(2) not in offload.tier
    matched = manager.match_prefix([h(0), h(1), h(2)])
    assert [manager.pool.block_hash(b) for b in matched] == [h(0), h(1)]
    manager.check_integrity()


def test_a_hash_registered_again_on_the_device_leaves_the_tier():
    manager, offload = make_manager(num_blocks=1, num_slots=2)
    fill(manager, offload, [h(0)], 1.0)
    fill(manager, offload, [h(1)], 2.0)
    assert h(0) in offload.tier
    fill(manager, offload, [h(0)], 1.0)  # recomputed without a match: device holds it again
    assert h(0) not in offload.tier and offload.tier.stats.discards == 1
    manager.check_integrity()


def test_tier_off_or_prefix_caching_off_builds_nothing():
    assert make_offload(SPEC, torch.zeros(SPEC.storage_shape(2)), 0) is None
    with pytest.raises(ValueError, match="kv-offload-memory"):
        make_offload(SPEC, torch.zeros(SPEC.storage_shape(2)), 4, tensor_parallel_size=2)
    for config in (DecodeEngineConfig, PrefillEngineConfig):
        with pytest.raises(ValueError, match="kv-offload-memory"):
            config(kv_offload_blocks=4, tensor_parallel_size=2)
    pool = BlockPool(2, 2)
    offload = KVOffload(SPEC, torch.zeros(SPEC.storage_shape(2)), 2)
    assert KVCacheManager(pool, enable_prefix_caching=False, offload=offload).offload is None


def test_promotion_waits_for_other_readers_before_overwriting_device_blocks():
    manager, offload = make_manager(num_blocks=2, num_slots=4)
    fill(manager, offload, [h(0), h(1)], 10.0)
    fill(manager, offload, [h(5), h(6)], 50.0)
    seen = []
    offload.before_write = lambda blocks: seen.append(
        [float(offload.device_tensor[b].flatten()[0]) for b in blocks]
    )
    assert len(manager.match_prefix([h(0), h(1)])) == 2
    assert seen == [[50.0, 51.0]] or seen == [[51.0, 50.0]], "called before the copy lands"


def test_metrics_name_the_tiers_counters_and_gauges_only_when_on():
    manager, offload = make_manager(num_blocks=1, num_slots=2)
    fill(manager, offload, [h(0)], 1.0)
    fill(manager, offload, [h(1)], 2.0)
    source = CounterSource("kv_offload_", lambda: offload_counts(manager), OFFLOAD_GAUGES)
    families = {f.name: f for f in StateCollector([], [source]).collect()}
    assert families["pagedserve:kv_offload_writes"].type == "counter"
    assert families["pagedserve:kv_offload_writes"].samples[0].value == 1
    assert families["pagedserve:kv_offload_write_bytes"].samples[0].value == SPEC.bytes_per_block
    assert families["pagedserve:kv_offload_blocks_cached"].type == "gauge"
    off = KVCacheManager(BlockPool(1, SPEC.block_size))
    assert offload_counts(off) is None
    off_source = CounterSource("kv_offload_", lambda: offload_counts(off), OFFLOAD_GAUGES)
    assert not list(StateCollector([], [off_source]).collect())
