"""The CPU fast path and the device dispatch against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_attention, cpu_native, dispatch, reference

LENS = [1, 16, 33, 64, 7, 300]


def expected(case, sliding_window=None, softcap=None, scale=None):
    return reference.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        case.scale if scale is None else scale,
        sliding_window,
        softcap,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 2, 16), (6, 6, 1)])
def test_cpu_decode_matches_reference(
    make_cpu_case, tolerance, dtype, num_heads, num_kv_heads, block_size
):
    case = make_cpu_case(
        seq_lens=LENS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        shared_blocks=1,
    )
    got = cpu_attention.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale
    )
    torch.testing.assert_close(got, expected(case), **tolerance(dtype))


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_cpu_mixed_batch_and_window_match_reference(make_cpu_case, tolerance, sliding_window):
    case = make_cpu_case(seq_lens=[20, 64, 150, 9], query_lens=[20, 3, 70, 1], num_heads=8)
    got = cpu_attention.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        case.scale,
        sliding_window,
    )
    torch.testing.assert_close(got, expected(case, sliding_window), **tolerance(torch.float32))
    decode = make_cpu_case(seq_lens=[5, 40, 100], num_heads=8)
    got = cpu_attention.paged_decode_attention(
        decode.query,
        decode.k_cache,
        decode.v_cache,
        decode.block_tables,
        decode.seq_lens,
        decode.scale,
        sliding_window,
    )
    torch.testing.assert_close(got, expected(decode, sliding_window), **tolerance(torch.float32))


def test_cpu_workspace_is_reused_and_grows(make_cpu_case):
    short, long = make_cpu_case(seq_lens=[16]), make_cpu_case(seq_lens=[500])
    for case in (short, long, short):
        got = cpu_attention.paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale
        )
        torch.testing.assert_close(got, expected(case), atol=2e-5, rtol=1e-5)


def make_meta(case) -> dispatch.AttentionMetadata:
    return dispatch.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=case.block_tables.long(),
        query_lens=case.query_lens,
        seq_lens=case.seq_lens,
    )


def test_dispatch_picks_the_backend_by_device_unless_forced():
    assert dispatch.backend_for(torch.device("cpu")) == "cpu"
    assert dispatch.backend_for(torch.device("cuda")) == "triton"
    with dispatch.use_backend("reference"):
        assert dispatch.backend_for(torch.device("cuda")) == "reference"
    assert dispatch.backend_for(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="backend"), dispatch.use_backend("tpu"):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_every_backend_agrees_through_dispatch(
    triton_modules, make_case, make_cpu_case, tolerance, backend
):
    # NOTE: the CPU path takes CPU tensors (on a GPU machine too); dispatch never sends it others
    make = make_cpu_case if backend == "cpu" else make_case
    case = make(seq_lens=[20, 64, 9], query_lens=[20, 3, 1])
    with dispatch.use_backend(backend):
        got = dispatch.paged_attention(
            case.query, case.k_cache, case.v_cache, make_meta(case), case.scale
        )
    torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


# -- Gemma's attention: soft cap, head_dim 256, a scale of its own, windows ---------------------

# (window, softcap): no window, a window of 5 (inside a block of 16, or across one boundary),
# one of 20 (across one or two boundaries)
GEMMA_CASES = [(None, 3.0), (5, 3.0), (20, 3.0), (20, None)]


NATIVE = pytest.param(
    "cpu-native",
    marks=pytest.mark.skipif(
        cpu_native.unavailable_reason() is not None,
        reason=f"no native kernel here: {cpu_native.unavailable_reason()}",
    ),
)


@pytest.mark.parametrize(("sliding_window", "softcap"), GEMMA_CASES)
@pytest.mark.parametrize("backend", [NATIVE, "cpu-torch", "triton"])
def test_every_backend_takes_gemmas_softcap_scale_and_head_dim_256(
    triton_modules, make_case, make_cpu_case, tolerance, monkeypatch, backend, sliding_window,
    softcap,
):  # fmt: skip
    # NOTE: a scale that is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar ** -0.5), so a
    # backend that recomputed it from head_dim would fail
    scale = 0.15
    monkeypatch.setattr(cpu_native, "enabled", backend != "cpu-torch")
    make = make_case if backend == "triton" else make_cpu_case
    mixed = make(seq_lens=[37, 50, 9, 64], query_lens=[1, 18, 9, 1], head_dim=256, num_heads=8)
    decode = make(seq_lens=[37, 50, 9, 64], head_dim=256, num_heads=8, seed=1)
    for case in (mixed, decode):
        meta = make_meta(case)
        with dispatch.use_backend("triton" if backend == "triton" else "cpu"):
            got = dispatch.paged_attention(
                case.query, case.k_cache, case.v_cache, meta, scale, sliding_window,
                softcap=softcap,
            )  # fmt: skip
        assert bool(meta._native_plans) == (backend == "cpu-native")  # the path under test ran
        want = expected(case, sliding_window, softcap, scale)
        torch.testing.assert_close(got, want, **tolerance(torch.float32))
    # the scale and the cap change the result
    assert (want - expected(case, sliding_window, softcap, 256**-0.5)).abs().max() > 0.05
    assert (
        softcap is None or (want - expected(case, sliding_window, None, scale)).abs().max() > 0.05
    )


def test_a_softcap_that_is_not_positive_is_refused(make_cpu_case):
    case = make_cpu_case(seq_lens=[3])
    for softcap in (0.0, -1.0):
        with pytest.raises(ValueError, match="softcap"):
            dispatch.paged_attention(
                case.query, case.k_cache, case.v_cache, make_meta(case), 0.5, softcap=softcap
            )


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_tiny_model_generates_the_reference_tokens_on_every_backend(
    triton_modules, make_tiny, device, backend
):
    from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
    from pagedserve.sampling_params import SamplingParams

    model_dir = make_tiny("llama")
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    config = DecodeEngineConfig(
        block_size=8,
        num_blocks=32,
        device=str(device if backend == "triton" else "cpu"),
        num_swap_blocks=0,
    )

    def generate():
        engine = DecodeEngine.from_model_dir(str(model_dir), config)
        return [seq.output_token_ids for seq in engine.generate(prompts, params)]

    with dispatch.use_backend("reference"):
        want = generate()
    with dispatch.use_backend(backend):
        assert generate() == want


# -- batched decode: buckets, padding, windows -------------------------------------------------

MIXED_LENS = [1, 15, 16, 17, 300]


def poison_unread(case, value: float, sliding_window=None) -> None:
    """Fill every K/V position no query may read with `value`, and point table padding at it.

    Read: sequence i's positions [seq_len - q_len - window + 1 .. seq_len) (all of them without a
    window). Everything else of this layer (free blocks, partial-block tails, positions before a
    window) is poisoned, so an output that touched one is no longer finite.
    """
    block_size = case.k_cache.shape[1]
    keep = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    used = set()
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        first = 0
        if sliding_window:
            first = max(0, seq_len - q_len + 1 - sliding_window)
        for pos in range(first, seq_len):
            keep[int(case.block_tables[i, pos // block_size]), pos % block_size] = True
        used.update(case.block_tables[i, : -(-seq_len // block_size)].tolist())
    free = next(b for b in range(case.k_cache.shape[0]) if b not in used)
    for i, seq_len in enumerate(case.seq_lens):
        case.block_tables[i, -(-seq_len // block_size) :] = free
    case.k_cache[~keep] = value
    case.v_cache[~keep] = value


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("sliding_window", [None, 12])
@pytest.mark.parametrize("block_size", [1, 16])
def test_batched_decode_never_reads_padding_or_stale_slots(
    make_cpu_case, tolerance, poison, sliding_window, block_size
):
    case = make_cpu_case(
        seq_lens=MIXED_LENS, num_heads=8, num_kv_heads=2, block_size=block_size, head_dim=32
    )
    want = expected(case, sliding_window)
    poison_unread(case, poison, sliding_window)
    got = cpu_attention.paged_decode_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        sliding_window,
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_decode_lengths_far_apart_split_into_buckets(make_cpu_case, tolerance):
    lens = [5, 600, 17, 300, 1, 290, 1000]
    case = make_cpu_case(seq_lens=lens, num_heads=8, num_kv_heads=2)
    poison_unread(case, float("nan"))
    plan = cpu_attention.plan_decode(case.block_tables, case.query_lens, lens, case.k_cache)
    spans = sorted(sorted(lens[int(r)] for r in b.rows.tolist()) for b in plan.buckets)
    assert spans == [[1, 5, 17], [290, 300], [600, 1000]]
    got = cpu_attention.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, lens, case.scale, plan=plan
    )
    torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


def test_equal_lengths_plan_one_unmasked_bucket_in_place(make_cpu_case):
    case = make_cpu_case(seq_lens=[40, 40, 40])
    plan = cpu_attention.plan_decode(
        case.block_tables, case.query_lens, case.seq_lens, case.k_cache
    )
    (bucket,) = plan.buckets
    assert bucket.rows is None and bucket.mask is None and bucket.pad is None
    assert bucket.keys == slice(0, 40)


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_mixed_batch_decode_rows_take_the_batched_path(make_cpu_case, tolerance, sliding_window):
    case = make_cpu_case(
        seq_lens=[17, 40, 300, 1, 33, 16],
        query_lens=[1, 40, 1, 1, 5, 1],
        num_heads=8,
        num_kv_heads=2,
    )
    want = expected(case, sliding_window)
    poison_unread(case, float("nan"), sliding_window)
    plan = cpu_attention.plan_decode(
        case.block_tables, case.query_lens, case.seq_lens, case.k_cache, sliding_window
    )
    rows = sorted(r for b in plan.buckets for r in b.rows.tolist())
    assert rows == [0, 41, 42, 48]  # the single-token sequences' rows of the flattened query
    got = cpu_attention.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        case.scale,
        sliding_window,
        plan,
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_dispatch_plans_once_per_step_for_every_layer(make_cpu_case, tolerance):
    case = make_cpu_case(seq_lens=MIXED_LENS, num_heads=8, num_kv_heads=2)
    meta = make_meta(case)
    outs = [
        dispatch.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)
        for _ in range(2)
    ]
    plan = meta.cpu_decode_plan(case.k_cache, None)
    assert meta.cpu_decode_plan(case.k_cache, None) is plan
    assert meta.cpu_decode_plan(case.k_cache, 8) is not plan
    for got in outs:
        torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


def test_a_plan_for_another_batch_is_refused(make_cpu_case):
    case = make_cpu_case(seq_lens=[3, 4])
    plan = cpu_attention.plan_decode(case.block_tables, [1], [3], case.k_cache)
    with pytest.raises(ValueError, match="query"):
        cpu_attention.paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, [3, 4], case.scale, plan=plan
        )


def test_buckets_stay_within_the_gather_byte_budget(make_cpu_case, tolerance, monkeypatch):
    # 2 KV heads x head_dim 16 x fp32, K and V: 256 bytes per position -> 96 positions a bucket
    monkeypatch.setattr(cpu_attention, "_BUCKET_BYTES", 96 * 256)
    lens = [40, 33, 47, 20, 45, 38, 1]
    case = make_cpu_case(seq_lens=lens)
    plan = cpu_attention.plan_decode(case.block_tables, case.query_lens, lens, case.k_cache)
    groups = sorted(sorted(lens[int(r)] for r in b.rows.tolist()) for b in plan.buckets)
    assert groups == [[1], [20, 33], [38, 40], [45, 47]]
    got = cpu_attention.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, lens, case.scale, plan=plan
    )
    torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_half_precision_buckets_hold_equal_spans_only(
    make_cpu_case, tolerance, dtype, sliding_window
):
    # windows of 20 over lengths 40 and 41 are equal spans at different block offsets
    lens = [40, 17, 40, 41, 17, 41]
    case = make_cpu_case(seq_lens=lens, dtype=dtype)
    plan = cpu_attention.plan_decode(
        case.block_tables, case.query_lens, lens, case.k_cache, sliding_window
    )
    groups = sorted(sorted(lens[int(r)] for r in b.rows.tolist()) for b in plan.buckets)
    assert groups == [[17, 17], [40, 40], [41, 41]]
    assert all(b.mask is None and b.pad is None for b in plan.buckets)
    got = cpu_attention.paged_decode_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        lens,
        case.scale,
        sliding_window,
        plan,
    )
    torch.testing.assert_close(got, expected(case, sliding_window), **tolerance(dtype))
