"""The CPU fast path and the device dispatch against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_attention, dispatch, reference

LENS = [1, 16, 33, 64, 7, 300]


def expected(case, sliding_window=None):
    return reference.paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        case.scale,
        sliding_window,
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
def test_every_backend_agrees_through_dispatch(triton_modules, make_case, tolerance, backend):
    case = make_case(seq_lens=[20, 64, 9], query_lens=[20, 3, 1])
    with dispatch.use_backend(backend):
        got = dispatch.paged_attention(
            case.query, case.k_cache, case.v_cache, make_meta(case), case.scale
        )
    torch.testing.assert_close(got, expected(case), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_tiny_model_generates_the_reference_tokens_on_every_backend(
    triton_modules, make_tiny, device, backend
):
    from pagedserve.model.engine import Engine, EngineConfig
    from pagedserve.sampling_params import SamplingParams

    model_dir = make_tiny("llama")
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=6)

    config = EngineConfig(
        block_size=8, num_blocks=32, device=str(device if backend == "triton" else "cpu")
    )

    def generate():
        engine = Engine.from_model_dir(str(model_dir), config)
        return [seq.output_token_ids for seq in engine.generate(prompts, params)]

    with dispatch.use_backend("reference"):
        want = generate()
    with dispatch.use_backend(backend):
        assert generate() == want
