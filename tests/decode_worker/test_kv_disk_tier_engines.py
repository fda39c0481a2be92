"""The disk tier in both engines (--kv-offload-dir, --kv-offload-disk): a prefix evicted from a
small device pool through a 2-slot host tier onto disk is promoted back from disk, its prompt
tokens counted as cached and the tokens equal to transformers'; a fresh engine on the same
directory finds it again (a restart); one of another configuration ignores the files; a
corrupt file is ignored, counted and recomputed; the directory stays within its size."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support.metric_docs import documented_metrics
from support.oracle import GREEDY, hf_greedy_on, hf_model, make_engine, make_prompts
from support.tiers import run_waves

from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.kvstore.disk_tier import FILE_HEADER_BYTES, RECORD_HEADER_BYTES, segment_name
from pagedserve.kvstore.hashing import hash_blocks
from pagedserve.kvstore.host_tier import OFFLOAD_GAUGES
from pagedserve.kvstore.kv_cache_manager import offload_counts
from pagedserve.metrics import CounterSource, StateCollector
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.sampling_params import SamplingParams

BLOCK = 8
PREFIX, TAIL_A, TAIL_B, OTHER_1, OTHER_2 = make_prompts((40, 3, 5, 60, 60), seed=5)
PROMPT_A, PROMPT_B = PREFIX + TAIL_A, PREFIX + TAIL_B
PREFIX_BLOCKS = len(PREFIX) // BLOCK
SHORT = SamplingParams(temperature=0.0, max_tokens=12)
DISK = 1 << 20


def hf_b(model_dir) -> list[int]:
    return hf_greedy_on(hf_model(model_dir, torch.float32), PROMPT_B, SHORT.max_tokens)


def disk_bytes(directory: Path) -> int:
    total = 0
    for path in directory.glob("seg-*.kvd"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # NOTE: the writer thread deleted it after the listing
            continue
    return total


def decode_engine(model_dir, directory: Path, capacity: int = DISK, **config):
    config = {"block_size": BLOCK, "num_blocks": 12, "max_num_batched_tokens": 64} | config
    return make_engine(
        model_dir, kv_offload_blocks=2, kv_offload_dir=str(directory),
        kv_offload_disk_bytes=capacity, **config,
    )  # fmt: skip


def run(engine, prompt, capacity: int = DISK):
    """Serve `prompt` to the end; integrity and the directory's size checked every step."""
    seq = engine.add_request(prompt, SHORT)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
        assert disk_bytes(engine.kv.offload.disk.directory) <= capacity
    return seq


def warm(engine) -> None:
    """A, then two other prompts: A's prefix leaves the device and the host tier for disk."""
    for prompt in (PROMPT_A, OTHER_1, OTHER_2):
        run(engine, prompt)
    disk = engine.kv.offload.disk
    disk.flush()
    assert disk.stats.writes >= PREFIX_BLOCKS and disk.num_blocks >= PREFIX_BLOCKS


def test_decode_engine_serves_an_evicted_prefix_from_disk(tiny_llama, tmp_path):
    engine = decode_engine(tiny_llama, tmp_path)
    warm(engine)
    seq = run(engine, PROMPT_B)
    engine.close()
    counts = engine.kv.offload.counts()
    assert counts.disk_promotions == PREFIX_BLOCKS, counts
    assert counts.disk_promotion_bytes == PREFIX_BLOCKS * engine.runner.spec.bytes_per_block
    assert seq.num_cached_prompt_tokens == len(PREFIX), "read from disk, not recomputed"
    assert seq.output_token_ids == hf_b(tiny_llama)
    exported = {s.name for m in offload_metrics(engine.kv) for s in m.samples}
    documented = {m for m in documented_metrics("Decode worker") if "kv_offload_disk" in m}
    documented |= {m for m in documented_metrics("Prefill worker") if "kv_offload_disk" in m}
    assert {m for m in exported if "disk" in m} == documented


def offload_metrics(kv):
    """The `kv_offload_*` families a worker's scrape shows (as the servers register them)."""
    source = CounterSource("kv_offload_", lambda: offload_counts(kv), OFFLOAD_GAUGES)
    return list(StateCollector([], [source]).collect())


def test_without_the_disk_tier_no_disk_series_are_exported(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK, num_blocks=12, kv_offload_blocks=2)
    names = {s.name for m in offload_metrics(engine.kv) for s in m.samples}
    engine.close()
    assert "pagedserve:kv_offload_writes_total" in names and not [n for n in names if "disk" in n]


def prefill(engine: PrefillEngine, request_id: str, prompt: list[int]):
    seq = engine.new_sequence(prompt, GREEDY, request_id=request_id)
    engine.add_sequence(seq)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    engine.free(seq.block_table)  # the lease ends at once: full blocks stay cached
    engine.check_integrity()
    return seq


def test_prefill_engine_promotes_a_prefix_from_disk_and_counts_it_cached(tiny_llama, tmp_path):
    config = PrefillEngineConfig(
        block_size=BLOCK, num_blocks=8, max_num_batched_tokens=64, use_shm=False,
        kv_offload_blocks=2, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK,
    )  # fmt: skip
    engine = PrefillEngine.from_model_dir(str(tiny_llama), config)
    for request_id, prompt in (("a", PROMPT_A), ("o1", OTHER_1), ("o2", OTHER_2)):
        prefill(engine, request_id, prompt)
    assert all(h in engine.kv.offload.disk for h in engine_hashes(engine, PREFIX))
    computed = engine.num_prompt_tokens_computed
    seq = prefill(engine, "b", PROMPT_B)
    assert seq.num_cached_prompt_tokens == len(PREFIX)
    assert engine.num_prompt_tokens_computed - computed == len(TAIL_B)
    assert engine.kv.offload.counts().disk_promotions == PREFIX_BLOCKS
    assert seq.output_token_ids[:1] == hf_b(tiny_llama)[:1]
    engine.close()


@pytest.fixture(scope="module")
def warmed(tiny_llama, tmp_path_factory):
    """A directory an engine warmed (A's prefix on disk) and closed, and where the prefix's
    first block lies (file number, record offset). Tests restart on a copy of it."""
    directory = tmp_path_factory.mktemp("warmed")
    engine = decode_engine(tiny_llama, directory)
    warm(engine)
    where = engine.kv.offload.disk._where[engine_hashes(engine, PREFIX)[0]]
    engine.close()
    return directory, where


def restart_on(warmed, tmp_path) -> tuple[Path, Path]:
    """A copy of the warmed directory, and the path of the file of the prefix's first block."""
    directory = tmp_path / "disk"
    shutil.copytree(warmed[0], directory)
    return directory, directory / segment_name(warmed[1][0])


def test_a_restarted_engine_serves_the_prefix_it_left_on_disk(tiny_llama, warmed, tmp_path):
    directory, _ = restart_on(warmed, tmp_path)
    engine = decode_engine(tiny_llama, directory)
    assert engine.kv.offload.disk.num_blocks >= PREFIX_BLOCKS, "found by the start-up scan"
    seq = run(engine, PROMPT_B)
    engine.close()
    assert seq.num_cached_prompt_tokens == len(PREFIX)
    assert engine.kv.offload.counts().disk_promotions == PREFIX_BLOCKS
    assert seq.output_token_ids == hf_b(tiny_llama)


@pytest.mark.parametrize("change", [{"block_size": 16}, {"dtype": "bfloat16"}])
def test_an_engine_of_another_configuration_ignores_the_files(tiny_llama, warmed, tmp_path, change):
    directory, _ = restart_on(warmed, tmp_path)
    files = len(list(directory.glob("seg-*.kvd")))
    other = decode_engine(tiny_llama, directory, **change)
    disk = other.kv.offload.disk
    assert disk.num_blocks == 0 and disk.stats.stale_files == files > 0
    assert not list(directory.glob("seg-*.kvd")), "another configuration's files are deleted"
    seq = run(other, PROMPT_B)
    other.close()
    assert seq.num_cached_prompt_tokens == 0


def test_a_corrupt_file_is_ignored_counted_and_the_prefix_recomputed(tiny_llama, warmed, tmp_path):
    directory, path = restart_on(warmed, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[warmed[1][1] + RECORD_HEADER_BYTES + 5] ^= 0x40  # one bit of the first block's payload
    path.write_bytes(raw)
    engine = decode_engine(tiny_llama, directory)
    disk = engine.kv.offload.disk
    assert engine_hashes(engine, PREFIX)[0] in disk, "payloads are checked on read, not at start"
    seq = run(engine, PROMPT_B)
    engine.close()
    assert disk.stats.corrupt_files == 1 and not path.exists()
    assert seq.num_cached_prompt_tokens == 0, "never served from a corrupt file"
    assert seq.output_token_ids == hf_b(tiny_llama)


def test_a_truncated_file_is_ignored_at_restart(tiny_llama, warmed, tmp_path):
    directory, path = restart_on(warmed, tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    engine = decode_engine(tiny_llama, directory)
    assert engine.kv.offload.disk.stats.corrupt_files == 1 and not path.exists()
    seq = run(engine, PROMPT_B)
    engine.close()
    assert seq.num_cached_prompt_tokens == 0
    assert seq.output_token_ids == hf_b(tiny_llama)


def test_the_directory_stays_within_its_size(tiny_llama, tmp_path):
    """Room for 4 blocks: many prompts spill more; the oldest files go first."""
    engine = decode_engine(tiny_llama, tmp_path)
    per_block = engine.runner.spec.bytes_per_block
    engine.close()
    capacity = 2 * FILE_HEADER_BYTES + 4 * (RECORD_HEADER_BYTES + per_block)
    engine = decode_engine(tiny_llama, tmp_path / "small", capacity)
    for prompt in make_prompts((50, 50, 50), seed=9):
        run(engine, prompt, capacity)
    engine.close()
    disk = engine.kv.offload.disk
    assert disk.stats.evictions > 0 and disk.num_blocks <= 4
    assert disk_bytes(tmp_path / "small") <= capacity


def engine_hashes(engine, tokens):
    return hash_blocks(tokens, BLOCK, model_fingerprint=engine.fingerprint)


def test_disk_tier_with_swap_preemption_keeps_transformers_tokens(tiny_llama, tmp_path):
    """A pool too small for the batch: sequences are swapped out while prefixes move between
    the device, the host tier and the disk; every token stays equal to transformers'."""
    engine = decode_engine(
        tiny_llama, tmp_path, num_blocks=14, max_num_batched_tokens=32, num_swap_blocks=64,
        preemption_mode=PreemptionMode.SWAP,
    )  # fmt: skip
    waves = [[PROMPT_A, OTHER_1], [OTHER_2, PROMPT_B, PREFIX + TAIL_B[:2]]]
    seqs, swapped = run_waves(engine, waves, SHORT)
    counts = engine.kv.offload.counts()
    assert swapped >= 1 and counts.disk_promotions >= 1, (swapped, counts)
    model = hf_model(tiny_llama, torch.float32)
    for prompt, seq in zip([p for wave in waves for p in wave], seqs, strict=True):
        assert seq.output_token_ids == hf_greedy_on(model, prompt, SHORT.max_tokens)
