"""`--kv-offload-memory` sizes the host tier of both workers, `--kv-offload-dir` and
`--kv-offload-disk` their disk tier, and `pagedserve up` passes them on (a directory per
worker) and counts them in each worker's memory plan; half-given disk flags are refused."""

import pytest

from pagedserve import launcher
from pagedserve.cli import build_parser
from pagedserve.decode_worker.engine import DecodeEngineConfig
from pagedserve.decode_worker.server import engine_config
from pagedserve.engine_sizing import size_engine
from pagedserve.prefill_worker.server import build_engine
from pagedserve.prefill_worker.server import engine_config as prefill_config

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


def test_the_disk_flags_build_a_bounded_disk_tier_below_the_host_tier(tiny_llama, tmp_path):
    disk_flags = ("--kv-offload-memory", "1MiB", "--kv-offload-dir", str(tmp_path / "d"),
                  "--kv-offload-disk", "2MiB")  # fmt: skip
    decode = parse("decode", "--model", str(tiny_llama), *disk_flags)
    config = engine_config(decode, size_engine(decode))
    assert (config.kv_offload_dir, config.kv_offload_disk_bytes) == (str(tmp_path / "d"), 2 * MIB)
    args = parse(
        "prefill", "--model", str(tiny_llama), "--no-shm", "--num-gpu-blocks-override", "8",
        *disk_flags,
    )  # fmt: skip
    engine = build_engine(args)
    try:
        disk = engine.kv.offload.disk
        assert disk is not None and disk.capacity_bytes == 2 * MIB
        assert disk.directory == tmp_path / "d" and disk.directory.is_dir()
        with pytest.raises(ValueError, match="kv-offload-dir: .* in use"):
            build_engine(args)  # NOTE: a second worker on the same directory
    finally:
        engine.close()
    plain = parse("decode", "--model", str(tiny_llama), "--kv-offload-memory", "1MiB")
    assert engine_config(plain, size_engine(plain)).kv_offload_dir is None


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (("--kv-offload-memory", "1MiB", "--kv-offload-dir", "D"),
         "kv-offload-dir: needs --kv-offload-disk"),
        (("--kv-offload-memory", "1MiB", "--kv-offload-disk", "1MiB"),
         "kv-offload-disk: needs --kv-offload-dir"),
        (("--kv-offload-dir", "D", "--kv-offload-disk", "1MiB"),
         "kv-offload-dir: .* needs --kv-offload-memory"),
        (("--kv-offload-memory", "1MiB", "--kv-offload-dir", "FILE", "--kv-offload-disk", "1MiB"),
         "kv-offload-dir: .* not a directory"),
    ],
)  # fmt: skip
def test_both_workers_and_up_refuse_half_given_disk_flags(tiny_llama, tmp_path, flags, refusal):
    (tmp_path / "FILE").write_text("x")
    flags = tuple(str(tmp_path / f) if f in ("D", "FILE") else f for f in flags)
    for role in ("prefill", "decode"):
        args = parse(role, "--model", str(tiny_llama), *flags)
        with pytest.raises(ValueError, match=refusal):
            (engine_config if role == "decode" else prefill_config)(args, size_engine(args))
    with pytest.raises(ValueError, match=refusal):
        launcher.check_disk_flags(parse("up", "--model", "m", *flags))
    assert launcher.main(parse("up", "--model", "m", *flags)) == 2


def test_the_disk_tier_is_refused_with_tensor_parallel_ranks(tmp_path):
    with pytest.raises(ValueError, match="kv-offload-dir: .* --tensor-parallel-size"):
        DecodeEngineConfig(
            tensor_parallel_size=2, kv_offload_blocks=0, kv_offload_dir=str(tmp_path),
            kv_offload_disk_bytes=MIB,
        )  # fmt: skip
    disk = ("--kv-offload-dir", str(tmp_path), "--kv-offload-disk", "1MiB")
    args = parse("up", "--model", "m", "--tensor-parallel-size", "2", "--kv-offload-memory",
                 "1MiB", *disk)  # fmt: skip
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        launcher.check_disk_flags(args)


def test_up_gives_each_worker_its_own_disk_directory_and_plans_it(tmp_path):
    given = parse("up", "--model", "m", "--kv-offload-memory", "64MiB",
                  "--kv-offload-dir", str(tmp_path), "--kv-offload-disk", "1GiB")  # fmt: skip
    plain = parse("up", "--model", "m", "--kv-offload-memory", "64MiB")
    for name in ("prefill-0", "decode-1"):
        role = name.split("-")[0]
        flags = launcher._worker_flags(role, given, name)
        assert flags[flags.index("--kv-offload-dir") + 1] == str(tmp_path / name)
        assert flags[flags.index("--kv-offload-disk") + 1] == "1GiB"
        plan = launcher.memory_plan(role, given, name)
        assert f"disk prefix tier 1024.0 MiB in {tmp_path / name}" in plan
        assert "--kv-offload-dir" not in launcher._worker_flags(role, plain, name)
        assert "disk prefix tier" not in launcher.memory_plan(role, plain, name)
