"""The 8-bit KV cache's write and read (kernels/kv_quant.py, dispatch with scales): codes and
scales as the rule says, the error they allow, blocks reused afresh, and attention over the
codes equal to the reference's over their values on every backend."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedserve.kernels import cpu_native, dispatch, kv_quant, native_plan, reference
from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.kernels.kv_quant import KV_QUANT_MAX
from pagedserve.kvstore.kv_cache import KVCache, KVCacheSpec

DTYPES = (torch.int8, torch.float8_e4m3fn)
BLOCK, HEADS, DIM = 4, 2, 8


def layer(dtype: torch.dtype, num_blocks: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    cache = KVCache(KVCacheSpec(1, HEADS, DIM, BLOCK, dtype), num_blocks)
    k, _ = cache.layer(0)
    ks, _ = cache.layer_scales(0)
    return k, ks


def values(n: int, seed: int, magnitude: float = 1.0, dim: int = DIM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, dim, generator=g) * magnitude


def read(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    ids = torch.tensor([block])
    return kv_quant.dequantize_blocks(codes, scales, ids, torch.float32)[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_blocks_codes_do_not_depend_on_how_its_tokens_were_cut_into_writes(dtype):
    codes, scales = layer(dtype)
    x = values(BLOCK, seed=1) * torch.tensor([0.5, 2.0, 1.0, 4.0])[:, None, None]
    cuts = {1: [BLOCK], 2: [1] * BLOCK, 3: [3, 1], 4: [1, 2, 1]}  # block -> write sizes
    for block, sizes in cuts.items():
        start = 0
        for n in sizes:
            slots = torch.arange(block * BLOCK + start, block * BLOCK + start + n)
            kv_quant.write_kv(codes, scales, x[start : start + n], slots)
            start += n
    bits = codes.view(torch.uint8)
    for block in (2, 3, 4):
        assert torch.equal(bits[block], bits[1]) and torch.equal(scales[block], scales[1])
    assert torch.equal(scales[1], x.abs().amax(dim=(0, 2)) / KV_QUANT_MAX[dtype])
    assert not bits[[0, 5]].any() and not scales[[0, 5]].any()  # other blocks untouched


def test_a_step_writing_many_blocks_equals_writing_each_alone():
    codes, scales = layer(torch.int8)
    alone_codes, alone_scales = layer(torch.int8)
    # a prefill of blocks 0-1 (6 tokens) and decode tokens into blocks 3 and 4, in one step
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 3 * BLOCK + 2, 4 * BLOCK])
    x = values(len(slots), seed=11)
    kv_quant.write_kv(alone_codes, alone_scales, values(2, seed=12), torch.tensor([12, 13]))
    kv_quant.write_kv(codes, scales, values(2, seed=12), torch.tensor([12, 13]))
    kv_quant.write_kv(codes, scales, x, slots)
    for part in (slice(0, 6), slice(6, 7), slice(7, 8)):
        kv_quant.write_kv(alone_codes, alone_scales, x[part], slots[part])
    assert torch.equal(codes, alone_codes) and torch.equal(scales, alone_scales)
    assert (read(codes, scales, 0) - x[:4]).abs().max() <= scales[0].max() * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_appending_larger_tokens_grows_the_scale_and_keeps_earlier_tokens(dtype):
    codes, scales = layer(dtype)
    x = values(BLOCK, seed=2) * torch.tensor([1.0, 3.0, 0.5, 9.0])[:, None, None]
    growths = 0
    for t in range(BLOCK):
        before = scales[1].clone()
        kv_quant.write_kv(codes, scales, x[t : t + 1], torch.tensor([BLOCK + t]))
        growths += bool((scales[1] > before).any()) and t > 0
    assert growths == 2  # tokens 1 and 3 are larger than all before them
    final = x.abs().amax(dim=(0, 2)) / KV_QUANT_MAX[dtype]
    assert torch.allclose(scales[1], final)  # the block spans its largest value
    err = (read(codes, scales, 1) - x).abs()
    if dtype == torch.int8:
        # each write rounds once (half a step), each growth re-rounds once more
        assert err.max() <= (growths + 1) * final.max() / 2 + 1e-6
    else:  # e4m3: 3 mantissa bits, relative rounding per (re-)encoding
        relative = (17 / 16) ** (growths + 1) - 1
        floor = (growths + 1) * final[None, :, None] * 2**-9  # the smallest subnormal step
        assert (err <= x.abs() * relative + floor + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_smaller_tokens_leave_earlier_codes_bit_for_bit(dtype):
    codes, scales = layer(dtype)
    kv_quant.write_kv(codes, scales, values(2, seed=3, magnitude=4.0), torch.tensor([0, 1]))
    first = codes[0, :2].clone()
    kv_quant.write_kv(codes, scales, values(2, seed=4, magnitude=0.01), torch.tensor([2, 3]))
    assert torch.equal(codes[0, :2].view(torch.uint8), first.view(torch.uint8))


def test_a_block_written_from_its_first_slot_forgets_its_old_scale():
    codes, scales = layer(torch.int8)
    kv_quant.write_kv(codes, scales, values(BLOCK, seed=5, magnitude=100.0), torch.arange(BLOCK))
    small = values(2, seed=6, magnitude=0.01)
    kv_quant.write_kv(codes, scales, small, torch.tensor([0, 1]))  # the block reused
    assert torch.equal(scales[0], small.abs().amax(dim=(0, 2)) / 127)
    assert (read(codes, scales, 0)[:2] - small).abs().max() <= scales[0].max() / 2 + 1e-9


def test_zero_values_give_zero_scale_and_codes():
    codes, scales = layer(torch.int8)
    kv_quant.write_kv(codes, scales, torch.zeros(3, HEADS, DIM), torch.tensor([4, 5, 6]))
    assert not scales[1].any() and not codes[1].any()
    assert torch.isfinite(read(codes, scales, 1)).all()


def test_fp8_codes_saturate_instead_of_overflowing_to_nan():
    codes, scales = layer(torch.float8_e4m3fn)
    x = values(BLOCK, seed=7, magnitude=1e4)
    kv_quant.write_kv(codes, scales, x, torch.arange(BLOCK))
    assert torch.isfinite(codes[0].to(torch.float32)).all()
    assert torch.isfinite(read(codes, scales, 0)).all()


def quantized_case(
    dtype: torch.dtype,
    query_lens: list[int],
    seq_lens: list[int],
    dim: int = DIM,
    softcap: float | None = None,
):
    """A two-sequence batch whose K/V sit as codes in shuffled blocks of a 12-block cache;
    `expected` is the reference's attention over their values (logits capped at `softcap`)."""
    num_blocks, heads_q = 12, 4
    cache = KVCache(KVCacheSpec(2, HEADS, dim, BLOCK, dtype), num_blocks)
    cache.tensor.fill_(0xFF)  # NaN in fp8 codes and scales: what is never written is never read
    (k, v), (ks, vs) = cache.layer(1), cache.layer_scales(1)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(8)).tolist()
    tables, slots = [], []
    for n in seq_lens:
        ids = [order.pop() for _ in range(-(-n // BLOCK))]
        tables.append(ids + [0] * (4 - len(ids)))
        slots.append(torch.tensor([ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]))
    for i, n in enumerate(seq_lens):  # context written the way decode writes it: a token a time
        for p in range(n):
            x = values(2, seed=100 * i + p, dim=dim)
            kv_quant.write_kv(k, ks, x[:1], slots[i][p : p + 1])
            kv_quant.write_kv(v, vs, x[1:], slots[i][p : p + 1])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [s[n - q :] for s, q, n in zip(slots, query_lens, seq_lens, strict=True)]
        ),
        block_tables=torch.tensor(tables),
        query_lens=query_lens,
        seq_lens=seq_lens,
    )
    query = torch.randn(sum(query_lens), heads_q, dim, generator=torch.Generator().manual_seed(9))
    everything = torch.arange(num_blocks)
    dense_k = kv_quant.dequantize_blocks(k, ks, everything, torch.float32)
    dense_v = kv_quant.dequantize_blocks(v, vs, everything, torch.float32)
    expected = reference.paged_attention(
        query, dense_k, dense_v, meta.block_tables, query_lens, seq_lens, dim**-0.5, None, softcap
    )
    return query, (k, v), (ks, vs), meta, expected


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "query_lens, seq_lens, softcap",
    [([1, 1], [7, 13], None), ([3, 1], [9, 5], None), ([1, 1], [7, 13], 0.5)],
    ids=["decode", "mixed", "decode-softcap"],
)
def test_attention_over_codes_equals_reference_over_their_values(
    backend, dtype, query_lens, seq_lens, softcap, triton_modules
):
    query, (k, v), scales, meta, expected = quantized_case(
        dtype, query_lens, seq_lens, softcap=softcap
    )
    if backend == "triton" and torch.cuda.is_available():  # NOTE: compiled Triton reads the GPU
        query, k, v = query.cuda(), k.cuda(), v.cuda()
        scales = tuple(s.cuda() for s in scales)
        meta = replace(meta, slot_mapping=meta.slot_mapping.cuda(),
                       block_tables=meta.block_tables.cuda())  # fmt: skip
    with dispatch.use_backend(backend):
        got = dispatch.paged_attention(query, k, v, meta, DIM**-0.5, scales=scales, softcap=softcap)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native kernel here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_the_native_kernel_reads_codes_in_place_like_the_reference(dtype, softcap, monkeypatch):
    query, (k, v), scales, meta, expected = quantized_case(
        dtype, [1, 1], [7, 13], dim=32, softcap=softcap
    )
    calls = []
    real = cpu_native.decode_quantized
    monkeypatch.setattr(cpu_native, "decode_quantized", lambda *a: calls.append(1) or real(*a))
    with dispatch.use_backend("cpu"):
        got = dispatch.paged_attention(query, k, v, meta, 32**-0.5, scales=scales, softcap=softcap)
    assert calls == [1] and meta._dense is None  # no dequantized copy was made
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native kernel here")
@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_alone_reads_codes_as_in_a_batch_bit_for_bit(dtype, threads):
    # NOTE: alone, the kernel gives each thread a KV head rather than a whole sequence
    query, (k, v), scales, meta, _ = quantized_case(dtype, [1, 1], [7, 13], dim=32)

    def attend(rows: slice) -> torch.Tensor:
        plan = native_plan.plan(meta.block_tables[rows], [1] * len(meta.seq_lens[rows]),
                                meta.seq_lens[rows], None)  # fmt: skip
        q = query[rows]
        return cpu_native.decode_quantized(plan, q, k, v, scales, 32**-0.5, torch.empty_like(q))

    batch = attend(slice(0, 2))
    for i in range(2):
        assert torch.equal(attend(slice(i, i + 1))[0], batch[i])


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native kernel here")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bf16_query_reads_codes_in_place_as_its_fp32_widening(dtype, monkeypatch):
    query, (k, v), scales, meta, _ = quantized_case(dtype, [1, 1], [7, 13], dim=32)
    query = query.bfloat16()
    calls = []
    real = cpu_native.decode_quantized
    monkeypatch.setattr(cpu_native, "decode_quantized", lambda *a: calls.append(1) or real(*a))
    with dispatch.use_backend("cpu"):
        got = dispatch.paged_attention(query, k, v, meta, 32**-0.5, scales=scales)
        wide = dispatch.paged_attention(query.float(), k, v, meta, 32**-0.5, scales=scales)
    assert calls and meta._dense is None  # the kernel, no dequantized copy
    assert got.dtype == torch.bfloat16 and torch.equal(got, wide.bfloat16())


def test_the_dense_view_reads_each_needed_block_once():
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, 0]),
        block_tables=torch.tensor([[7, 3, 9, 0], [7, 5, 0, 0]]),  # block 7 shared, a fork
        query_lens=[1, 1],
        seq_lens=[9, 6],  # 3 and 2 blocks: the padding and block 9's neighbours are not read
    )
    used, dense = meta.dense_view(BLOCK)
    assert used.tolist() == [3, 5, 7, 9]
    assert dense.block_tables[:, :3].tolist() == [[2, 0, 3], [2, 1, 0]]
    assert meta.dense_view(BLOCK)[1] is dense  # built once per step


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native kernel here")
def test_the_native_decode_write_equals_the_torch_rule_bit_for_bit(monkeypatch):
    """Decode steps (one token per block) through the C write and through torch, from the same
    state: the same codes and scales, scales growing and blocks starting afresh included."""
    native_codes, native_scales = layer(torch.int8, num_blocks=8)
    torch_codes, torch_scales = layer(torch.int8, num_blocks=8)
    calls = []
    real = cpu_native.append_int8

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(cpu_native, "append_int8", spy)
    g = torch.Generator().manual_seed(21)
    for step in range(3 * BLOCK):
        slots = (
            torch.tensor([1, 4, 6]) * BLOCK + step % BLOCK
        )  # three sequences, each in its own block
        x = torch.randn(3, HEADS, DIM, generator=g) * (1 + step % 5)  # some steps grow scales
        kv_quant.write_kv(native_codes, native_scales, x, slots, one_per_block=True)
        with monkeypatch.context() as m:
            m.setattr(cpu_native, "enabled", False)
            kv_quant.write_kv(torch_codes, torch_scales, x, slots, one_per_block=True)
        assert torch.equal(native_codes, torch_codes) and torch.equal(native_scales, torch_scales)
    assert calls == [True, False] * 3 * BLOCK  # the C write, then torch's
    assert native_scales[[1, 4, 6]].min() > 0
