"""`--kv-offload-memory` sizes the host tier of both workers, and `pagedserve up` passes it on
and counts it in each worker's memory plan."""

from pagedserve import launcher
from pagedserve.cli import build_parser
from pagedserve.decode_worker.server import engine_config
from pagedserve.engine_sizing import size_engine
from pagedserve.prefill_worker.server import build_engine

MIB = 1 << 20


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_the_flag_sizes_the_tier_in_blocks_and_defaults_to_off(tiny_llama):
    args = parse("decode", "--model", str(tiny_llama), "--kv-offload-memory", "1MiB")
    sizing = size_engine(args)
    assert engine_config(args, sizing).kv_offload_blocks == MIB // sizing.bytes_per_block > 0
    default = parse("decode", "--model", str(tiny_llama))
    assert engine_config(default, size_engine(default)).kv_offload_blocks == 0


def test_the_prefill_flag_builds_the_engines_tier(tiny_llama):
    args = parse(
        "prefill", "--model", str(tiny_llama), "--no-shm", "--num-gpu-blocks-override", "8",
        "--kv-offload-memory", "1MiB",
    )  # fmt: skip
    engine = build_engine(args)
    try:
        offload = engine.kv.offload
        assert offload is not None and offload.num_slots == MIB // offload.bytes_per_block
        assert engine.pool.num_blocks == 8
    finally:
        engine.close()


def test_up_passes_the_flag_and_plans_its_memory_only_when_given():
    given = parse("up", "--model", "m", "--kv-offload-memory", "64MiB")
    plain = parse("up", "--model", "m")
    for role in ("prefill", "decode"):
        flags = launcher._worker_flags(role, given)
        assert flags[flags.index("--kv-offload-memory") + 1] == "64MiB"
        assert "host prefix tier 64.0 MiB" in launcher.memory_plan(role, given)
        assert "--kv-offload-memory" not in launcher._worker_flags(role, plain)
        assert "host prefix tier" not in launcher.memory_plan(role, plain)
