"""Cache write, copy-on-write block copy and swap: exact, on strided views of the pool."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference, swap


def make_pool(device, num_blocks=8, block_size=4, dtype=torch.float32, seed=0):
    """[num_blocks, num_layers=3, 2, block_size, num_kv_heads=2, head_dim=16] of random values."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 3, 2, block_size, 2, 16, generator=g)
    return pool.to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reshape_and_cache_writes_slots_like_the_reference(
    triton_modules, device, dtype, block_size
):
    _, cache_ops = triton_modules
    pool = make_pool(device, num_blocks=6, block_size=block_size, dtype=dtype)
    want = pool.clone()
    num_slots = 6 * block_size
    slots = torch.randperm(num_slots)[: min(num_slots, 21)].to(device)
    key = torch.randn(len(slots), 2, 16, device=device)  # float32 in, cast to the cache dtype
    value = torch.randn(len(slots), 2, 16, device=device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    cache_ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
    reference.write_kv(want[:, 1, 0], want[:, 1, 1], key, value, slots)
    assert torch.equal(pool, want)


def test_reshape_and_cache_skips_negative_slots_and_reads_strided_inputs(triton_modules, device):
    _, cache_ops = triton_modules
    pool = make_pool(device)
    before = pool.clone()
    qkv = torch.randn(3, 3, 2, 16, device=device)  # [tokens, q/k/v, heads, dim]: strided k, v
    slots = torch.tensor([5, -1, 30], device=device)
    cache_ops.reshape_and_cache(qkv[:, 1], qkv[:, 2], pool[:, 0, 0], pool[:, 0, 1], slots)
    assert torch.equal(pool[1, 0, 0, 1], qkv[0, 1]) and torch.equal(pool[7, 0, 1, 2], qkv[2, 2])
    changed = (pool != before).any(dim=(1, 2, 4, 5)).nonzero().tolist()
    assert changed == [[1, 1], [7, 2]]


def test_copy_blocks_duplicates_whole_pages_of_every_layer(triton_modules, device):
    _, cache_ops = triton_modules
    pool = make_pool(device)
    want = pool.clone()
    pairs = [(2, 5), (0, 7), (2, 6)]
    cache_ops.copy_blocks(pool, pairs)
    reference.copy_blocks(want, pairs)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("pairs", [[(1, 2), (2, 3)], [(1, 4), (2, 4)], [(1, 8)]])
def test_copy_blocks_rejects_chained_duplicate_or_out_of_range_pairs(triton_modules, device, pairs):
    _, cache_ops = triton_modules
    with pytest.raises(ValueError, match="pairs"):
        cache_ops.copy_blocks(make_pool(device), pairs)


def test_swap_out_and_back_in_restores_blocks_exactly(device):
    gpu_pool = make_pool(device, num_blocks=8, seed=1)
    host = torch.zeros(6, *gpu_pool.shape[1:], pin_memory=device.type == "cuda")
    out_pairs = [(3, 0), (4, 1), (5, 2), (0, 5)]  # a run of three, then one
    swap.swap_blocks(gpu_pool, host, out_pairs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for src, dst in out_pairs:
        assert torch.equal(host[dst], gpu_pool[src].cpu())
    assert torch.equal(host[3:5], torch.zeros_like(host[3:5]))
    restored = torch.zeros_like(gpu_pool)
    swap.swap_blocks(host, restored, [(d, s) for s, d in out_pairs])
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(restored[[3, 4, 5, 0]], gpu_pool[[3, 4, 5, 0]])
    assert torch.equal(restored[[1, 2, 6, 7]], torch.zeros_like(restored[[1, 2, 6, 7]]))


def test_swap_within_one_device_matches_the_reference(device):
    src, dst, want = make_pool(device, seed=2), make_pool(device, seed=3), make_pool(device, seed=3)
    pairs = [(7, 0), (1, 3), (2, 4)]
    swap.swap_blocks(src, dst, pairs)
    reference.swap_blocks(src, want, pairs)
    assert torch.equal(dst, want)


def test_swap_rejects_pools_of_different_specs(device):
    with pytest.raises(ValueError, match="pools differ"):
        swap.swap_blocks(make_pool(device), make_pool(device, block_size=8), [(0, 0)])
