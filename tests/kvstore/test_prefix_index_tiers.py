"""Tiered blocks in the Redis prefix index: a real prefill engine with a small device pool and
a host tier (and a disk tier below it) publishes, through the real `IndexPublisher` and a real
redis-server, each block where it sits: `dev`, `host` or `disk`; a promoted block is `dev`
again, a block that leaves every tier is gone, the lookup counts tiered blocks, and a
republish after Redis lost everything restores every entry in its tier."""

from __future__ import annotations

import pytest
from support.oracle import make_prompts
from support.redis_server import RedisServer

from pagedserve.cluster import join_indexed
from pagedserve.kvstore.block_pool import Tier
from pagedserve.kvstore.hashing import BlockHash, hash_blocks
from pagedserve.kvstore.index_publisher import IndexEvents, IndexPublisher
from pagedserve.kvstore.prefix_index import RedisPrefixIndex
from pagedserve.kvstore.worker_registry import Role, WorkerRegistry, connect
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker_load import WorkerLoad

BLOCK = 8
MODEL, WORKER, INC = "tiny", "prefill-0", "inc1"
PREFIX, TAIL_B, *OTHERS = make_prompts((40, 5, 60, 60, 60, 60), seed=7)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


class Held:
    """The engine as the publisher's `HashSource` (what a worker's `registered_hashes` is)."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    def registered_hashes(self) -> dict[BlockHash, Tier]:
        return self.engine.kv.held_hashes()


class Env:
    def __init__(self, server: RedisServer, engine: PrefillEngine) -> None:
        self.client = connect(server.url)
        self.registry = WorkerRegistry(self.client, MODEL)
        self.registry.register(WORKER, "127.0.0.1:1", Role.PREFILL, incarnation=INC)
        self.index = RedisPrefixIndex(self.client, MODEL, block_size=BLOCK)
        self.publisher = IndexPublisher(self.index, WORKER, INC, Held(engine))
        self.engine = engine
        self.prefix = hash_blocks(PREFIX, BLOCK, model_fingerprint=engine.fingerprint)
        self.seen: set[BlockHash] = set()

    def prefill(self, prompt: list[int]) -> int:
        """Prefill `prompt`, publish the step's events; the prompt tokens found cached."""
        seq = self.engine.new_sequence(prompt, ONE, request_id=f"r{len(self.seen)}")
        self.engine.add_sequence(seq)
        while self.engine.has_unfinished:
            self.publisher.publish(self.engine.step().events)
        self.engine.free(seq.block_table)
        self.publisher.publish(self.engine.pool.drain_events())
        self.engine.check_integrity()
        self.seen |= set(hash_blocks(prompt, BLOCK, model_fingerprint=self.engine.fingerprint))
        self.assert_index_mirrors_the_engine()
        return seq.num_cached_prompt_tokens

    def tiers(self, hashes: list[BlockHash]) -> list[Tier | None]:
        return [self.index.holders(h).get(WORKER) for h in hashes]

    def assert_index_mirrors_the_engine(self) -> None:
        held = self.engine.kv.held_hashes()
        seen = sorted(self.seen)
        assert self.tiers(seen) == [held.get(h) for h in seen]


def make_env(server: RedisServer, model_dir, **tiers) -> Env:
    config = PrefillEngineConfig(
        block_size=BLOCK, num_blocks=8, max_num_batched_tokens=64, use_shm=False, **tiers
    )
    return Env(server, PrefillEngine.from_model_dir(str(model_dir), config))


def test_host_tier_blocks_are_published_as_host_then_dev_then_gone(
    tiny_llama, redis_server: RedisServer
) -> None:
    env = make_env(redis_server, tiny_llama, kv_offload_blocks=8)
    n = len(env.prefix)
    env.prefill(PREFIX + TAIL_B)
    assert env.tiers(env.prefix) == [Tier.DEV] * n
    env.prefill(OTHERS[0])  # needs the whole pool: the prefix goes to the host tier
    assert env.tiers(env.prefix) == [Tier.HOST] * n
    assert env.index.lookup(env.prefix) == {WORKER: n}, "host blocks count for the worker"
    assert env.prefill(PREFIX + TAIL_B) == len(PREFIX), "promoted, not recomputed"
    assert env.tiers(env.prefix) == [Tier.DEV] * n
    for other in OTHERS:  # 4 x 7 blocks through an 8-block host tier: the prefix leaves it
        env.prefill(other)
    assert env.tiers(env.prefix) == [None] * n
    assert env.index.lookup(env.prefix) == {}
    env.engine.close()


def test_republish_after_redis_lost_everything_restores_each_tier(
    tiny_llama, redis_server: RedisServer
) -> None:
    env = make_env(redis_server, tiny_llama, kv_offload_blocks=8)
    env.prefill(PREFIX + TAIL_B)
    env.prefill(OTHERS[0])
    held = env.engine.kv.held_hashes()
    assert set(held.values()) == {Tier.DEV, Tier.HOST}
    env.client.flushall()
    assert env.registry.heartbeat(), "the record was lost"  # a worker then republishes:
    env.publisher.refresh(force=True)
    env.assert_index_mirrors_the_engine()
    assert env.tiers(env.prefix) == [Tier.HOST] * len(env.prefix)
    env.engine.close()


@pytest.mark.parametrize("disk_blocks", [64, 6])
def test_disk_tier_blocks_are_published_as_disk_and_removed_with_their_file(
    tiny_llama, redis_server: RedisServer, tmp_path, disk_blocks: int
) -> None:
    """A 2-slot host tier spills to disk: the prefix is `disk` in the index, `dev` once
    promoted; with room for 6 blocks, evicted files' blocks are removed (the mirror check
    after every prefill covers both); a reset of the prefix cache removes every entry."""
    probe = make_env(redis_server, tiny_llama)
    per_block = probe.engine.runner.spec.bytes_per_block
    probe.engine.close()
    env = make_env(
        redis_server, tiny_llama, kv_offload_blocks=2, kv_offload_dir=str(tmp_path),
        kv_offload_disk_bytes=disk_blocks * (per_block + 64) + 64,
    )  # fmt: skip
    n = len(env.prefix)
    env.prefill(PREFIX + TAIL_B)
    env.prefill(OTHERS[0])
    # NOTE: a chain's leaves leave a tier first, so its root is the last to reach disk
    assert env.tiers(env.prefix) == [Tier.HOST] * 2 + [Tier.DISK] * (n - 2)
    if disk_blocks == 64:
        assert env.index.lookup(env.prefix) == {WORKER: n}
        assert env.prefill(PREFIX + TAIL_B) == len(PREFIX)
        assert env.tiers(env.prefix) == [Tier.DEV] * n
    for other in OTHERS[1:]:
        env.prefill(other)
    assert (env.engine.kv.offload.disk.stats.evictions > 0) == (disk_blocks == 6)
    env.engine.pool.reset_prefix_cache()  # every tier emptied: every entry removed
    env.publisher.publish(env.engine.pool.drain_events())
    assert env.tiers(sorted(env.seen)) == [None] * len(env.seen)
    env.engine.close()


def test_a_restarted_worker_publishes_its_disk_blocks_when_it_joins(
    tiny_llama, redis_server: RedisServer, tmp_path
) -> None:
    """Only the disk tier survives a restart; the new incarnation's join republishes it, so
    the router sees the prefix before any request (no event announced those blocks)."""
    disk = {
        "kv_offload_blocks": 2,
        "kv_offload_dir": str(tmp_path),
        "kv_offload_disk_bytes": 1 << 24,
    }
    first = make_env(redis_server, tiny_llama, **disk)
    first.prefill(PREFIX + TAIL_B)
    first.prefill(OTHERS[0])
    on_disk = [h for h in first.prefix if h in first.engine.kv.offload.disk]
    assert on_disk, "part of the prefix must reach the disk"
    first.engine.close()
    config = PrefillEngineConfig(
        block_size=BLOCK, num_blocks=8, max_num_batched_tokens=64, use_shm=False, **disk
    )
    engine = PrefillEngine.from_model_dir(str(tiny_llama), config)
    member = join_indexed(
        first.client, MODEL, WORKER, "127.0.0.1:1", Role.PREFILL, WorkerLoad, Held(engine),
        IndexEvents(), compat="", incarnation="inc2", block_size=BLOCK,
    )  # fmt: skip
    try:
        assert [first.index.holders(h) for h in on_disk] == [{WORKER: Tier.DISK}] * len(on_disk)
    finally:
        member.leave()
        engine.close()
