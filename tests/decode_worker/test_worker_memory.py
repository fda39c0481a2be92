"""Memory you asked for, not more: the swap space is sized from the KV budget by default and its
pages are committed only as blocks are swapped into (a real `pagedserve decode` process)."""

from __future__ import annotations

import argparse
import pathlib

import torch
from support.workers import start, wait_ready

from pagedserve.decode_worker.server import swap_space_gib
from pagedserve.kvstore.kv_cache import KVCacheSpec
from pagedserve.kvstore.swap_space import GIB, SwapSpace
from pagedserve.launcher import memory_plan

MIB = 1 << 20


def rss_bytes(pid: int | str = "self") -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def test_decode_worker_with_a_small_kv_budget_stays_small(tiny_llama, tmp_path):
    worker = start("decode", ["--model", str(tiny_llama), "--kv-cache-memory", "2MiB"],
                   tmp_path / "decode.log")  # fmt: skip
    try:
        wait_ready(worker)
        rss = rss_bytes(worker.proc.pid)
    finally:
        worker.kill()
    print(f"decode worker RSS with --kv-cache-memory 2MiB: {rss / MIB:.0f} MiB")
    assert rss < 1 << 30  # was ~4.6 GB: a 4 GiB swap space zero-filled at start


def test_default_swap_space_is_the_kv_pool_capped_at_4_gib():
    assert swap_space_gib(None, 2 * MIB) == 2 * MIB / GIB
    assert swap_space_gib(None, 64 * GIB) == 4.0
    assert swap_space_gib(0.0, 2 * MIB) == 0.0  # an explicit flag wins, 0 included
    assert swap_space_gib(8.0, 2 * MIB) == 8.0


def test_unpinned_swap_space_commits_pages_only_when_written():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float32)  # fmt: skip
    before = rss_bytes()
    space = SwapSpace.from_gib(spec, 0.5)
    assert space is not None and not space.is_pinned
    assert rss_bytes() - before < 64 * MIB  # 512 MiB reserved, almost nothing resident
    space.tensor[:8].fill_(1.0)  # a swap-out writes whole blocks: they become resident
    assert bool((space.tensor[:8] == 1.0).all())


def test_up_plans_each_workers_memory_from_the_flags():
    args = argparse.Namespace(kv_cache_memory="2MiB", swap_space=None)
    assert memory_plan("prefill", args) == "KV cache 2.0 MiB"
    assert memory_plan("decode", args).startswith("KV cache 2.0 MiB + host swap up to 2.0 MiB")
    args.swap_space = 0.5
    assert "host swap up to 512.0 MiB" in memory_plan("decode", args)
