"""`--eviction-policy` reaches the block pool of both workers, and `pagedserve up` passes it on."""

from pagedserve import launcher
from pagedserve.cli import build_parser
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.server import engine_config
from pagedserve.engine_sizing import size_engine
from pagedserve.kvstore.eviction import DEFAULT_EVICTION_POLICY, EvictionPolicy
from pagedserve.prefill_worker.engine import PrefillEngineConfig
from pagedserve.prefill_worker.server import build_engine


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_both_workers_default_to_the_default_policy(tiny_llama):
    for role in ("prefill", "decode"):
        assert parse(role, "--model", str(tiny_llama)).eviction_policy == "hits"
    assert DecodeEngineConfig().eviction_policy is DEFAULT_EVICTION_POLICY
    assert PrefillEngineConfig().eviction_policy is DEFAULT_EVICTION_POLICY


def test_the_decode_flag_reaches_the_engine_pool(tiny_llama):
    args = parse("decode", "--model", str(tiny_llama), "--eviction-policy", "lru")
    config = engine_config(args, size_engine(args))
    assert config.eviction_policy is EvictionPolicy.LRU
    engine = DecodeEngine.from_model_dir(
        str(tiny_llama), DecodeEngineConfig(num_blocks=8, eviction_policy=config.eviction_policy)
    )
    try:
        assert engine.pool.eviction_policy is EvictionPolicy.LRU
    finally:
        engine.close()


def test_the_prefill_flag_reaches_the_engine_pool(tiny_llama):
    for policy in EvictionPolicy:
        args = parse(
            "prefill", "--model", str(tiny_llama), "--no-shm",
            "--num-gpu-blocks-override", "8", "--eviction-policy", policy.value,
        )  # fmt: skip
        assert build_engine(args).pool.eviction_policy is policy


def test_up_passes_the_flag_to_workers_only_when_given():
    given = parse("up", "--model", "m", "--eviction-policy", "lru")
    for role in ("prefill", "decode"):
        flags = launcher._worker_flags(role, given)
        assert flags[flags.index("--eviction-policy") + 1] == "lru"
        assert "--eviction-policy" not in launcher._worker_flags(role, parse("up", "--model", "m"))
