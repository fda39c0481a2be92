"""The native fp32 and bf16 CPU decode kernel (kernels/cpu_native.py) against the reference,
through dispatch and the engine, and its fallback when it cannot be built."""

from __future__ import annotations

import pytest
import torch
from support.oracle import hf_greedy, make_prompts, run_engine

from pagedserve.kernels import cpu_native, dispatch, native_plan, reference

BLOCKER = cpu_native.build_blocker()
# NOTE: the kernel is x86-64 C for AVX-512 or AVX2 + FMA; a host with neither, or without a C
# compiler, cannot run it (its attention takes the torch path, tested in test_cpu_attention.py).
# CI and the project's machines (Xeons with AVX-512, AMD EPYCs with AVX2) have both, and there
# `test_the_kernel_builds_...` fails if it is missing.
needs_kernel = pytest.mark.skipif(BLOCKER is not None, reason=f"no native kernel: {BLOCKER}")


def expected(case, sliding_window=None, softcap=None, scale=None):
    return reference.paged_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.query_lens,
        case.seq_lens, case.scale if scale is None else scale, sliding_window, softcap,
    )  # fmt: skip


def native(case, sliding_window=None, softcap=None, scale=None):
    plan = native_plan.plan(case.block_tables, case.query_lens, case.seq_lens, sliding_window)
    out = torch.full_like(case.query, float("nan"))
    scale = case.scale if scale is None else scale
    return cpu_native.decode(plan, case.query, case.k_cache, case.v_cache, scale, out, softcap)


def test_the_kernel_builds_where_the_machine_can_build_it():
    # NOTE: not a skip: on an AVX-512 or AVX2 host with a C compiler (this project's machines, CI)
    # the kernel must be there, else decode silently runs the slower torch path
    reason = cpu_native.unavailable_reason()
    if BLOCKER is None:
        assert reason is None
    else:
        assert reason == BLOCKER


@needs_kernel
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 16), (9, 3, 64, 16), (8, 8, 32, 8), (8, 2, 128, 16), (6, 1, 64, 1)],
)
def test_decode_matches_the_reference(
    make_cpu_case, tolerance, num_heads, num_kv_heads, head_dim, block_size
):
    case = make_cpu_case(
        seq_lens=[1, 15, 16, 17, 33, 64, 300, 7],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        shared_blocks=1,
    )
    assert cpu_native.supports(case.query, case.k_cache)
    torch.testing.assert_close(native(case), expected(case), **tolerance(torch.float32))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_mixed_batch_and_window_match_the_reference(
    make_cpu_case, tolerance, sliding_window, dtype
):
    case = make_cpu_case(seq_lens=[20, 64, 150, 9, 40], query_lens=[20, 1, 70, 1, 3],
                         num_heads=8, head_dim=32, dtype=dtype)  # fmt: skip
    meta = dispatch.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=case.block_tables,
        query_lens=case.query_lens,
        seq_lens=case.seq_lens,
    )
    got = dispatch.paged_attention(
        case.query, case.k_cache, case.v_cache, meta, case.scale, sliding_window
    )
    assert (sliding_window, False) in meta._native_plans  # the native kernel ran, not torch
    torch.testing.assert_close(got, expected(case, sliding_window), **tolerance(dtype))
    # the decode rows alone: the prefill rows of `out` are left as they were
    only_decode = native(case, sliding_window)
    assert torch.isnan(only_decode[:20]).all() and not torch.isnan(only_decode[20]).any()
    torch.testing.assert_close(only_decode[20], got[20])


@needs_kernel
def test_stale_and_nan_slots_never_reach_an_output(make_cpu_case, tolerance):
    case = make_cpu_case(seq_lens=[5, 17, 40], num_heads=8, head_dim=32)
    want = expected(case)
    table = case.block_tables
    # poison every slot no sequence attends: the tails of the last blocks and unused blocks
    used = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(case.seq_lens):
        for pos in range(n):
            used[table[i, pos // case.k_cache.shape[1]], pos % case.k_cache.shape[1]] = True
    case.k_cache[~used] = float("nan")
    case.v_cache[~used] = float("nan")
    torch.testing.assert_close(native(case), want, **tolerance(torch.float32))


def alone(case, i):
    """Sequence i of `case` as a batch of its own."""
    q = case.query[i : i + 1]
    plan = native_plan.plan(case.block_tables[i : i + 1], [1], [case.seq_lens[i]], None)
    return cpu_native.decode(plan, q, case.k_cache, case.v_cache, case.scale, torch.empty_like(q))


@needs_kernel
@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (6, 1), (8, 8)])
def test_a_sequence_alone_attends_as_in_a_batch_bit_for_bit(
    make_cpu_case, threads, num_heads, num_kv_heads
):
    # NOTE: alone, fewer sequences than threads, the kernel gives each thread KV heads rather
    # than whole sequences; a head's outputs must not depend on it (batch invariance)
    case = make_cpu_case(seq_lens=[300, 17, 64], num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=64)  # fmt: skip
    batch = native(case)
    for i in range(len(case.seq_lens)):
        assert torch.equal(alone(case, i)[0], batch[i])


@needs_kernel
@pytest.mark.parametrize(("sliding_window", "block_size"), [(None, 16), (5, 16), (20, 16), (20, 1)])
def test_softcapped_decode_matches_the_reference(make_cpu_case, tolerance, sliding_window,
                                                 block_size):  # fmt: skip
    # windows inside one block and across block boundaries; Gemma's head_dim and a scale that
    # is not head_dim ** -0.5; the cap (3) well inside the logits' range (~ +-8)
    case = make_cpu_case(seq_lens=[1, 15, 16, 17, 33, 64, 7], num_heads=8, num_kv_heads=2,
                         head_dim=256, block_size=block_size, shared_blocks=1)  # fmt: skip
    assert cpu_native.supports(case.query, case.k_cache, softcap=3.0)
    got = native(case, sliding_window, softcap=3.0, scale=0.15)
    want = expected(case, sliding_window, softcap=3.0, scale=0.15)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    uncapped = expected(case, sliding_window, scale=0.15)
    assert (want - uncapped).abs().max() > 0.05


@needs_kernel
def test_decode_takes_head_dims_that_are_multiples_of_16_up_to_256(make_cpu_case, tolerance):
    # NOTE: the kernel walks head_dim in vectors of 8 or 16 floats and sizes its scratch from it:
    # powers of two and others (80, 144, 208), up to Gemma's 256
    for head_dim in (48, 80, 144, 208, 256):
        case = make_cpu_case(seq_lens=[17, 40], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                             block_size=8, seed=head_dim)  # fmt: skip
        for softcap in (None, 2.0):
            assert cpu_native.supports(case.query, case.k_cache, softcap)
            got = native(case, softcap=softcap, scale=0.3)
            want = expected(case, softcap=softcap, scale=0.3)
            torch.testing.assert_close(got, want, **tolerance(torch.float32), msg=str(head_dim))
        half = make_cpu_case(seq_lens=[17, 40], num_heads=4, num_kv_heads=2,
                             head_dim=head_dim, block_size=8, dtype=torch.bfloat16)  # fmt: skip
        assert ulps_apart(native(half, scale=0.3), expected(half, scale=0.3)).max() <= 1


@needs_kernel
def test_bf16_with_a_softcap_takes_the_torch_path(make_cpu_case, tolerance):
    """The bf16 kernel follows SDPA's roundings; transformers caps in eager attention, rounding
    each step to bf16, as the reference and the torch path do."""
    case = make_cpu_case(seq_lens=[5, 40, 17], num_heads=8, head_dim=32, dtype=torch.bfloat16)
    assert cpu_native.supports(case.query, case.k_cache)
    assert not cpu_native.supports(case.query, case.k_cache, softcap=2.0)
    meta = dispatch.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=case.block_tables,
        query_lens=case.query_lens, seq_lens=case.seq_lens,
    )  # fmt: skip
    with dispatch.use_backend("cpu"):
        got = dispatch.paged_attention(
            case.query, case.k_cache, case.v_cache, meta, case.scale, softcap=2.0
        )
    assert not meta._native_plans
    torch.testing.assert_close(got, expected(case, softcap=2.0), **tolerance(torch.bfloat16))
    with pytest.raises(ValueError, match="softcap"):
        native(case, softcap=2.0)


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair is (both finite, the same sign)."""
    assert torch.equal(got.sign(), want.sign())
    return (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()


@needs_kernel
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 16), (9, 3, 64, 16), (8, 8, 32, 8), (8, 2, 128, 16), (6, 1, 64, 1)],
)
def test_bf16_decode_rounds_as_sdpa(make_cpu_case, num_heads, num_kv_heads, head_dim, block_size):
    # NOTE: the kernel computes what torch's CPU flash attention computes (its exp on whole
    # vectors, the weights rounded to bf16 before P.V, keys in blocks of 512): only the fp32
    # summation order of the dot products differs, so an output is rarely one bf16 step off
    case = make_cpu_case(
        seq_lens=[1, 15, 16, 17, 33, 64, 300, 512, 7, 513, 1100],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        shared_blocks=1,
        dtype=torch.bfloat16,
    )
    assert cpu_native.supports(case.query, case.k_cache)
    got, want = native(case), expected(case)
    apart = ulps_apart(got, want)
    # NOTE: more than one step apart only where the output is small against its row (the sums
    # cancel, so fp32 order differences show): seen on an Intel Xeon (AVX512-BF16), 1 output
    # of 11,264 three steps apart; there within one bf16 step of the row's largest value
    far = apart > 1
    row_scale = want.float().abs().amax(dim=-1, keepdim=True).expand_as(want)
    error = (got.float() - want.float()).abs()
    assert (error[far] <= 2**-8 * row_scale[far]).all(), error[far]
    assert int(far.sum()) <= 2
    assert apart.float().mean() < 2e-3, f"{int(apart.sum())} of {apart.numel()} differ"


@needs_kernel
def test_bf16_stale_and_nan_slots_never_reach_an_output(make_cpu_case):
    case = make_cpu_case(seq_lens=[5, 17, 40], num_heads=8, head_dim=32, dtype=torch.bfloat16)
    want = expected(case)
    used = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(case.seq_lens):
        for pos in range(n):
            used[
                case.block_tables[i, pos // case.k_cache.shape[1]], pos % case.k_cache.shape[1]
            ] = True
    case.k_cache[~used] = float("nan")
    case.v_cache[~used] = float("inf")
    assert ulps_apart(native(case), want).max() <= 1


@needs_kernel
def test_the_bf16_engine_decodes_through_the_kernel_and_equals_transformers(
    tiny_llama, monkeypatch
):
    calls = []
    original = cpu_native.decode

    def counting(plan, query, *args, **kwargs):
        calls.append(query.dtype)
        return original(plan, query, *args, **kwargs)

    monkeypatch.setattr(cpu_native, "decode", counting)
    prompts = make_prompts()
    _, seqs = run_engine(tiny_llama, prompts, dtype="bfloat16")
    assert torch.bfloat16 in calls, "bf16 decode never took the native kernel"
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, _ = hf_greedy(tiny_llama, torch.bfloat16, tuple(prompt))
        assert seq.output_token_ids == want, f"prompt of {len(prompt)} tokens"


def test_other_dtypes_and_shapes_take_the_torch_path(make_cpu_case):
    half = make_cpu_case(seq_lens=[5, 9], dtype=torch.float16)
    assert not cpu_native.supports(half.query, half.k_cache)
    mixed = make_cpu_case(seq_lens=[5, 9])
    assert not cpu_native.supports(mixed.query.bfloat16(), mixed.k_cache)
    odd = make_cpu_case(seq_lens=[5, 9], head_dim=24)
    assert not cpu_native.supports(odd.query, odd.k_cache)


def test_a_failed_build_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if cpu_native.build_blocker() is not None:  # another CPU: refused before compiling
        with pytest.raises(RuntimeError):
            cpu_native._build()
        return
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native._build()
    assert not list((tmp_path / "pagedserve" / "kernels").glob("*"))  # no partial file left


@needs_kernel
def test_the_engine_decodes_through_the_kernel_and_equals_transformers(tiny_llama, monkeypatch):
    calls = []
    original = cpu_native.decode

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_native, "decode", counting)
    prompts = make_prompts()
    _, seqs = run_engine(tiny_llama, prompts)
    assert calls, "decode never took the native kernel"
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, _ = hf_greedy(tiny_llama, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want


@needs_kernel
@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [
        (1, 37, 64, 32),
        (5, 64, 96, 32),
        (17, 9, 128, 64),
        (4, 3, 32, 16),
        (1, 19, 576, 576),
        (3, 21, 64, 64),
    ],
)
def test_grouped_int8_linear_equals_linear_on_the_dequantized_weight(m, n, k, group):
    # NOTE: group == k is per-channel int8, whose kernel applies the scale to the row's sum
    g = torch.Generator().manual_seed(m * n)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 100
    x = torch.randn(m, k, generator=g)
    weight = (codes.float().view(n, -1, group) * scales[..., None]).view(n, k)
    got = cpu_native.linear_int8_groups(x, codes, scales)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-5)
    bf16 = cpu_native.linear_int8_groups(x.bfloat16(), codes, scales)  # widened to fp32 first
    torch.testing.assert_close(bf16, x.bfloat16().float() @ weight.T, rtol=1e-5, atol=1e-5)


def test_grouped_int8_linear_declines_what_it_cannot_take():
    codes = torch.zeros(4, 40, dtype=torch.int8)
    assert cpu_native.linear_int8_groups(torch.ones(1, 40), codes, torch.ones(4, 5)) is None  # 8
    assert cpu_native.linear_int8_groups(torch.ones(1, 40), codes[:, ::2], torch.ones(4, 1)) is None


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, 32), (9, 576, 576), (64, 96, 16)])
def test_grouped_int8_linear_one_row_equals_that_row_of_a_batch(n, k, group):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) / 100
    x = torch.randn(5, k, generator=g)
    batch = cpu_native.linear_int8_groups(x, codes, scales)
    assert batch is not None
    for i in range(5):  # the one-row path (decode of one sequence) and the tiled one, bit for bit
        assert torch.equal(
            cpu_native.linear_int8_groups(x[i : i + 1], codes, scales), batch[i : i + 1]
        )


@needs_kernel
def test_per_channel_int8_with_fp32_activations_reads_the_codes_natively(monkeypatch):
    from pagedserve.model.quant import QuantizedLinear, WeightQuant

    layer = QuantizedLinear(64, 24, True, WeightQuant("int8"))
    g = torch.Generator().manual_seed(1)
    layer.load_weight(torch.randn(24, 64, generator=g))
    with torch.no_grad():
        layer.bias.copy_(torch.randn(24, generator=g))
    calls = []
    original = cpu_native.linear_int8_groups
    monkeypatch.setattr(
        cpu_native, "linear_int8_groups", lambda *a: calls.append(a[2].shape) or original(*a)
    )
    x = torch.randn(3, 64, generator=g)
    got = layer(x)
    assert calls == [(24, 1)]  # one scale per row: a group of the whole row
    want = torch.nn.functional.linear(x, layer.dequantize(), layer.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_scores_made_16_at_a_time_equal_one_at_a_time_bit_for_bit():
    """The kernel reduces 16 positions' products (8 with AVX2) in one transposed sum and the tail
    one position at a time: both must add in the same tree, or a score would depend on where
    its position falls."""
    lib = cpu_native.library()
    width = 16 if cpu_native.vector_width() == 16 else 8
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        mantissas = torch.rand(width * width, generator=gen) - 0.5
        v = mantissas * torch.pow(2.0, torch.randint(-20, 20, (width * width,), generator=gen))
        tiled, single = torch.empty(width), torch.empty(width)
        assert lib.sum_lanes_check(v.data_ptr(), tiled.data_ptr(), single.data_ptr()) == width
        assert torch.equal(tiled, single)
