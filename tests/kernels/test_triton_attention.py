"""Triton paged attention (decode, split-K, prefill over a paged prefix) against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference

# context lengths: 1, exact block multiples, ragged and long-ish
LENS = [1, 16, 33, 64, 7, 300, 129, 256]


def expected(case, sliding_window=None, softcap=None):
    return reference.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        case.scale,
        sliding_window,
        softcap,
    )


def run_triton(triton_modules, case, sliding_window=None, num_splits=1, softcap=None):
    attention, _ = triton_modules
    return attention.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_start_loc(),
        case.seq_lens_tensor(),
        max(case.query_lens),
        case.scale,
        sliding_window,
        num_splits,
        softcap,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference_in_every_dtype(
    triton_modules, make_case, tolerance, dtype, num_splits
):
    case = make_case(seq_lens=LENS, dtype=dtype)
    got = run_triton(triton_modules, case, num_splits=num_splits)
    torch.testing.assert_close(got, expected(case), **tolerance(dtype))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (4, 1), (6, 2), (8, 2), (32, 4), (7, 7)]
)
def test_decode_handles_any_gqa_ratio(
    triton_modules, make_case, tolerance, num_heads, num_kv_heads
):
    case = make_case(seq_lens=[5, 48, 70], num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(
        run_triton(triton_modules, case), expected(case), **tolerance(torch.float32)
    )


@pytest.mark.parametrize(("block_size", "head_dim"), [(1, 16), (8, 64), (32, 128), (128, 64)])
def test_decode_handles_block_sizes_and_head_dims(
    triton_modules, make_case, tolerance, block_size, head_dim
):
    lens = [1, block_size, 3 * block_size, 2 * block_size + 5]
    case = make_case(seq_lens=lens, block_size=block_size, head_dim=head_dim, num_heads=8)
    for num_splits in (1, 4):
        got = run_triton(triton_modules, case, num_splits=num_splits)
        torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


def test_decode_reads_a_block_shared_by_two_sequences(triton_modules, make_case, tolerance):
    case = make_case(seq_lens=[40, 45, 20], shared_blocks=2)
    assert torch.equal(case.block_tables[0, :2], case.block_tables[1, :2])
    torch.testing.assert_close(
        run_triton(triton_modules, case), expected(case), **tolerance(torch.float32)
    )


def test_split_k_with_more_splits_than_key_tiles_matches(triton_modules, make_case, tolerance):
    case = make_case(seq_lens=[1, 3, 200])
    got = run_triton(triton_modules, case, num_splits=8)
    torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_sliding_window_sees_only_the_last_window(
    triton_modules, make_case, tolerance, num_splits
):
    case = make_case(seq_lens=[5, 40, 100])
    got = run_triton(triton_modules, case, sliding_window=24, num_splits=num_splits)
    want = expected(case, sliding_window=24)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert not torch.allclose(want[-1], expected(case)[-1], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_over_a_paged_prefix_matches_reference(triton_modules, make_case, tolerance, dtype):
    # whole prompts, chunks after a cached prefix and decode tokens in one flattened batch
    case = make_case(seq_lens=[20, 64, 150, 9], query_lens=[20, 3, 70, 1], dtype=dtype)
    got = run_triton(triton_modules, case)
    torch.testing.assert_close(got, expected(case), **tolerance(dtype))


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(6, 2, 8), (8, 1, 1)])
def test_prefill_handles_gqa_and_block_sizes(
    triton_modules, make_case, tolerance, num_heads, num_kv_heads, block_size
):
    case = make_case(
        seq_lens=[33, 80],
        query_lens=[33, 50],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        shared_blocks=1,
    )
    got = run_triton(triton_modules, case)
    torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


def test_prefill_sliding_window_matches_reference(triton_modules, make_case, tolerance):
    case = make_case(seq_lens=[70, 100], query_lens=[70, 30])
    got = run_triton(triton_modules, case, sliding_window=16)
    torch.testing.assert_close(got, expected(case, 16), **tolerance(torch.float32))


def test_attention_reads_strided_layer_views_in_place(triton_modules, make_case):
    case = make_case(seq_lens=[30])
    assert not case.k_cache.is_contiguous()
    before = case.pool.clone()
    run_triton(triton_modules, case)
    assert torch.equal(case.pool, before)


@pytest.mark.parametrize(
    ("query_lens", "num_splits", "sliding_window"),
    [(None, 1, None), (None, 3, 20), ([30, 1, 17], 1, 5), ([30, 1, 17], 1, 20)],
    ids=["decode", "split-k-window-20", "prefill-window-5", "prefill-window-20"],
)
def test_softcap_with_windows_matches_reference(
    triton_modules, make_case, tolerance, query_lens, num_splits, sliding_window
):
    # windows inside one block of 16 and across block boundaries; a cap (1.5) the logits pass
    case = make_case(seq_lens=[30, 50, 17], query_lens=query_lens, head_dim=32, num_heads=8)
    got = run_triton(triton_modules, case, sliding_window, num_splits, softcap=1.5)
    want = expected(case, sliding_window, softcap=1.5)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert (want - expected(case, sliding_window)).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softcap_in_half_precision_matches_reference(triton_modules, make_case, tolerance, dtype):
    case = make_case(seq_lens=[20, 40], query_lens=[20, 1], dtype=dtype)
    got = run_triton(triton_modules, case, softcap=1.5)
    torch.testing.assert_close(got, expected(case, softcap=1.5), **tolerance(dtype))


def test_a_head_dim_that_is_not_a_power_of_two_matches_reference(
    triton_modules, make_case, tolerance
):
    # NOTE: 80 pads to 128 (masked dims); Gemma's 256 runs in test_cpu_attention.py's dispatch test
    case = make_case(seq_lens=[9, 40, 70], query_lens=[9, 1, 1], head_dim=80)
    for num_splits in (1, 2):
        got = run_triton(triton_modules, case, 20, num_splits, softcap=2.0)
        torch.testing.assert_close(got, expected(case, 20, 2.0), **tolerance(torch.float32))
