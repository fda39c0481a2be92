"""The native rope and SwiGLU activation (csrc/layer_ops.c) against the torch ops they replace
in model/llama.py, on a decode step's few rows and a prompt's many (split between threads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_layer_ops, cpu_linear, cpu_native
from pagedserve.model.llama import MLP, rotate, rotated

BLOCKER = cpu_native.build_blocker()
needs_kernel = pytest.mark.skipif(BLOCKER is not None, reason=f"no native kernel: {BLOCKER}")


def tables(tokens: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D] of random positions, laid out as RotaryEmbedding.at gives them."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(tokens, 1, dim // 2, generator=g) * 300
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300: rows split between threads
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (3, 1, 6)])
def test_rope_in_place_equals_torchs_rotate_bit_for_bit(tokens, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(tokens * dim + heads)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g) * 4
    cos, sin = tables(tokens, dim, seed=dim)
    qk = qkv.split([heads + kv_heads, kv_heads], dim=1)[0]  # rows strided as in Attention
    want = rotate(qk, (cos, sin))
    v_before = qkv[:, heads + kv_heads :].clone()
    assert cpu_layer_ops.rope_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # v's heads untouched


@needs_kernel
def test_rope_declines_what_it_cannot_take_and_rotated_falls_back_to_torch():
    x = torch.randn(5, 4, 64)
    cos, sin = tables(5, 64, seed=1)
    want = rotate(x, (cos, sin))
    for args in (
        (x.bfloat16(), cos.bfloat16(), sin.bfloat16()),  # another dtype
        (x, cos[..., :32].contiguous(), sin[..., :32].contiguous()),  # partial rotary (Phi-3)
        (x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin),  # heads not packed in rows
    ):
        before = args[0].clone()
        assert not cpu_layer_ops.rope_(*args)
        assert torch.equal(args[0], before)
    bf16 = x.bfloat16()
    out = rotated(bf16, (cos.bfloat16(), sin.bfloat16()))
    assert out is not bf16 and torch.equal(out, rotate(bf16, (cos.bfloat16(), sin.bfloat16())))
    same = x.clone()
    assert rotated(same, (cos, sin)) is same and torch.equal(same, want)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5, 260])
@pytest.mark.parametrize("inter", [1536, 37])  # SmolLM2's width, an odd tail
def test_silu_mul_equals_torch_within_a_few_ulp(tokens, inter):
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = torch.randn(tokens, 2 * inter, generator=g) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_layer_ops.silu_mul(gate, up)
    assert got is not None and got.shape == (tokens, inter)
    # NOTE: libmvec's expf against torch's: a few ulp of the activation, never more
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    rows = torch.cat(
        [cpu_layer_ops.silu_mul(gate[i : i + 1], up[i : i + 1]) for i in range(tokens)]
    )
    assert torch.equal(got, rows)  # a row's result whatever the batch and its split
    apart = cpu_layer_ops.silu_mul(gate.contiguous(), up.contiguous())  # two linears' outputs
    assert apart is not None and torch.equal(apart, got)


@needs_kernel
def test_the_mlp_takes_torch_where_the_kernel_cannot(monkeypatch):
    # the fields an MLP reads of a ModelConfig
    config = SimpleNamespace(
        hidden_size=32, intermediate_size=48, mlp_bias=False, hidden_act="silu"
    )
    mlp = MLP(config)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        mlp.fused_weight = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight))
        mlp.fused_bias, mlp.fused = None, True
        x = torch.randn(4, 32, generator=g)
        native = mlp(x)
        monkeypatch.setattr(cpu_native, "enabled", False)
        assert cpu_layer_ops.silu_mul(torch.ones(1, 8), torch.ones(1, 8)) is None
        plain = mlp(x)
        gate, up = cpu_linear.linear(x, mlp.fused_weight).chunk(2, dim=-1)
        assert torch.equal(plain, mlp.down_proj(F.silu(gate) * up))
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-6)
