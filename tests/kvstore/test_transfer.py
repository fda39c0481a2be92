"""KV transports: shared memory across real processes, and chunked streaming."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from pagedserve.kernels import kv_quant
from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec
from pagedserve.kvstore.transfer import (
    BlockAssembler,
    BlockChunk,
    ShmBlockReader,
    ShmKVPool,
    TransferError,
    iter_block_chunks,
    layout_compat_hash,
)

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.bfloat16)


def fill(cache: KVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g).to(cache.tensor.dtype))


def _consumer(offer, spec, src_ids, queue):  # runs in a spawned process
    reader = ShmBlockReader(offer, spec)
    local = KVCache(spec, 4)
    reader.read_blocks(src_ids, local, [2, 0])
    reader.close()
    queue.put((local.tensor[2].float().tolist(), local.tensor[0].float().tolist()))


def test_a_consumer_process_reads_blocks_through_shared_memory_and_leaves_the_segment():
    pool = ShmKVPool(SPEC, 8)
    try:
        fill(pool.cache, seed=1)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_consumer, args=(pool.offer(), SPEC, [5, 3], queue))
        proc.start()
        got5, got3 = queue.get(timeout=60)
        proc.join(timeout=30)
        assert proc.exitcode == 0
        assert got5 == pool.cache.tensor[5].float().tolist()
        assert got3 == pool.cache.tensor[3].float().tolist()
        # the consumer's exit must not have unlinked the producer's segment
        assert os.path.exists(f"/dev/shm/{pool.segment_name}")
    finally:
        pool.close()
    assert not os.path.exists(f"/dev/shm/{pool.segment_name}")


def test_a_gone_segment_or_foreign_layout_is_a_transfer_error():
    pool = ShmKVPool(SPEC, 2)
    offer = pool.offer()
    other = KVCacheSpec(2, 2, 8, 4, torch.bfloat16)
    with pytest.raises(TransferError, match="layout"):
        ShmBlockReader(offer, other)
    pool.close()
    with pytest.raises(TransferError, match="gone"):
        ShmBlockReader(offer, SPEC)


def test_block_ids_outside_the_pool_are_refused():
    pool = ShmKVPool(SPEC, 2)
    reader = ShmBlockReader(pool.offer(), SPEC)
    try:
        with pytest.raises(TransferError, match="out of range"):
            reader.read_blocks([2], KVCache(SPEC, 4), [0])
    finally:
        reader.close()
        pool.close()


@pytest.mark.parametrize("max_chunk_bytes", [1 << 20, 100, 7])
def test_chunked_stream_reassembles_the_selected_blocks(max_chunk_bytes):
    src = KVCache(SPEC, 6)
    fill(src, seed=2)
    handle_blocks = [4, 1, 5]  # the handle's block list, in token order
    dst = KVCache(SPEC, 6)
    assembler = BlockAssembler(dst, {0: 3, 2: 0})  # block index -> consumer block id
    chunks = list(iter_block_chunks(src, handle_blocks, max_chunk_bytes, indices=[0, 2]))
    assert all(len(c.data) <= max_chunk_bytes for c in chunks)
    for chunk in chunks:
        assert not assembler.complete
        assembler.feed(chunk)
    assert assembler.complete
    assert torch.equal(dst.tensor[3], src.tensor[4])
    assert torch.equal(dst.tensor[0], src.tensor[5])
    assert not dst.tensor[[1, 2, 4, 5]].any()


def test_out_of_order_short_or_unexpected_chunks_are_transfer_errors():
    src = KVCache(SPEC, 2)
    fill(src, seed=3)
    chunks = list(iter_block_chunks(src, [0, 1], 64))
    with pytest.raises(TransferError, match="out of order"):
        BlockAssembler(KVCache(SPEC, 2), {0: 0, 1: 1}).feed(chunks[1])
    with pytest.raises(TransferError, match="unexpected"):
        BlockAssembler(KVCache(SPEC, 2), {0: 0}).feed(chunks[-1])
    short = BlockChunk(0, 0, 0, chunks[0].data, last_of_block=True)
    with pytest.raises(TransferError, match="shorter"):
        BlockAssembler(KVCache(SPEC, 2), {0: 0}).feed(short)


def test_compat_hash_separates_layouts_and_models():
    base = layout_compat_hash(SPEC, b"model-a")
    assert len(base) == 16
    assert base == layout_compat_hash(SPEC, b"model-a")
    assert base != layout_compat_hash(SPEC, b"model-b")
    assert base != layout_compat_hash(KVCacheSpec(2, 2, 4, 8, torch.bfloat16), b"model-a")
    assert base != layout_compat_hash(KVCacheSpec(2, 2, 4, 4, torch.float16), b"model-a")
    int8 = KVCacheSpec(2, 2, 4, 4, torch.int8)
    fp8 = KVCacheSpec(2, 2, 4, 4, torch.float8_e4m3fn)
    eight_bit = {layout_compat_hash(spec, b"model-a") for spec in (int8, fp8)}
    assert len({base, *eight_bit}) == 3
    # a rank's shard of a tensor-parallel worker: the rank count is part of it (TP 2 of one
    # replicated KV head has TP 1's shape, but not its hand-off)
    assert layout_compat_hash(SPEC, b"model-a", 1) == base
    assert len({base, *(layout_compat_hash(SPEC, b"model-a", n) for n in (2, 4))}) == 3


INT8 = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.int8)


def fill_quantized(cache: KVCache, seed: int) -> None:
    """Real codes and scales, written as a decode worker writes them, in every layer."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(cache.num_blocks * cache.spec.block_size)
    for layer in range(cache.spec.num_layers):
        for codes, scales in zip(cache.layer(layer), cache.layer_scales(layer), strict=True):
            kv_quant.write_kv(codes, scales, torch.randn(len(slots), 2, 4, generator=g), slots)


def values_of(cache: KVCache, block: int) -> list[torch.Tensor]:
    ids = torch.tensor([block])
    return [
        kv_quant.dequantize_blocks(codes, scales, ids, torch.float32)
        for layer in range(cache.spec.num_layers)
        for codes, scales in zip(cache.layer(layer), cache.layer_scales(layer), strict=True)
    ]


def test_an_8bit_block_moves_with_its_scales_over_shm_and_the_stream():
    assert INT8.bytes_per_block == INT8.codes_bytes + 2 * 2 * 2 * 4  # float32 per layer, kv, head
    pool = ShmKVPool(INT8, 4)
    try:
        fill_quantized(pool.cache, seed=4)
        assert pool.cache.scales.min() > 0
        reader = ShmBlockReader(pool.offer(), INT8)
        by_shm = KVCache(INT8, 4)
        reader.read_blocks([3, 1], by_shm, [0, 2])
        reader.close()
        by_stream = KVCache(INT8, 4)
        assembler = BlockAssembler(by_stream, {0: 0, 1: 2})
        for chunk in iter_block_chunks(pool.cache, [3, 1], 13):
            assembler.feed(chunk)
        assert assembler.complete
        for dst in (by_shm, by_stream):
            for mine, theirs in ((0, 3), (2, 1)):
                for got, want in zip(
                    values_of(dst, mine), values_of(pool.cache, theirs), strict=True
                ):
                    assert torch.equal(got, want)
    finally:
        pool.close()
