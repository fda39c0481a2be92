"""The native int4 group linear (kernels/csrc/linear_i4g.c through cpu_native) against `x @ W.T`
on the dequantized weight, its batch invariance, and `QuantizedLinear`'s use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_dequant, cpu_native
from pagedserve.model.quant import QuantizedLinear, WeightQuant

needs_kernel = pytest.mark.skipif(
    cpu_native.build_blocker() is not None, reason=f"no native kernel: {cpu_native.build_blocker()}"
)
GROUPS = (32, 64, 128, 256)  # cli_options.QUANTIZATION_GROUP_SIZES


def make_weights(n: int, k: int, group: int, seed: int = 0):
    """(codes [n, k], scale, zero [n, k / group], the dequantized weight [n, k]), the scale and
    the minimum `zero - 8 scale` float16 values, as the layout holds them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) / 50).half().float()
    zero = (torch.randn(n, k // group, generator=g) / 20).half().float() + 8 * scale
    weight = (codes.float().view(n, -1, group) - 8) * scale[..., None] + zero[..., None]
    return codes, scale, zero, weight.view(n, k)


def test_the_layout_puts_16_rows_side_by_side_8_codes_a_word_and_reads_back():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (37, 64), generator=g)  # two tiles of 16 rows and one of 5
    packed = cpu_native.pack_int4(codes)
    assert packed.shape == (37, 32) and packed.dtype == torch.uint8
    words = packed.reshape(-1).view(torch.int32)  # little-endian words

    def word(row: int, chunk: int) -> int:  # the word of codes 8 chunk .. 8 chunk + 7 of `row`
        tile, at = divmod(row, 16)
        rows = min(16, 37 - 16 * tile)
        return words[tile * 16 * 8 + chunk * rows + at].item() & 0xFFFFFFFF

    for row, chunk in [(0, 0), (15, 0), (1, 7), (16, 3), (33, 0), (36, 7)]:
        want = sum(codes[row, 8 * chunk + j].item() << (4 * j) for j in range(8))
        assert word(row, chunk) == want
    assert torch.equal(cpu_native.unpack_int4(packed), codes.int())
    for n in (1, 16, 20, 48):
        some = torch.randint(0, 16, (n, 96), generator=g)
        assert torch.equal(cpu_native.unpack_int4(cpu_native.pack_int4(some)), some.int())


SHAPES = [(1, 37, 576), (1, 576, 1536), (3, 9, 576), (16, 61, 1536), (5, 192, 256)]


@needs_kernel
@pytest.mark.parametrize(  # every group size that divides the layer's width (as the loader asks)
    ("m", "n", "k", "group"), [(*shape, g) for shape in SHAPES for g in GROUPS if shape[2] % g == 0]
)
def test_int4_linear_equals_x_times_the_dequantized_weight(m, n, k, group):
    codes, scale, zero, weight = make_weights(n, k, group, seed=m * n + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    pairs = cpu_native.pack_int4_scales(scale, zero)
    got = cpu_native.linear_int4_groups(x, cpu_native.pack_int4(codes), pairs)
    assert got is not None and got.dtype == torch.float32 and got.shape == (m, n)
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * k)


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group"), [(37, 576, 32), (13, 1536, 256), (64, 256, 64)])
def test_int4_linear_one_row_equals_that_row_of_a_batch(n, k, group):
    codes, scale, zero, _ = make_weights(n, k, group, seed=n)
    packed, pairs = cpu_native.pack_int4(codes), cpu_native.pack_int4_scales(scale, zero)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(n + k))
    batch = cpu_native.linear_int4_groups(x, packed, pairs)
    assert batch is not None
    for i in range(7):  # the one-row path (decode of one sequence) and the tiled one, bit for bit
        one = cpu_native.linear_int4_groups(x[i : i + 1], packed, pairs)
        assert torch.equal(one, batch[i : i + 1])


def test_the_pairs_lie_tile_by_tile_a_groups_16_scales_then_their_minimums():
    scale = torch.rand(37, 3).half().float()  # two tiles of 16 rows and one of 5
    low = torch.randn(37, 3).half().float()
    pairs = cpu_native.pack_int4_scales(scale, low + 8 * scale)
    assert pairs.shape == (3, 3, 2, 16) and pairs.dtype == torch.float16 and pairs.is_contiguous()
    flat = pairs.reshape(-1)
    for row, group in [(0, 0), (15, 2), (16, 1), (36, 2)]:
        tile, at = divmod(row, 16)
        first = (tile * 3 + group) * 32 + at  # a group of a tile: 32 halves, one cache line
        assert flat[first].item() == scale[row, group].item()
        assert flat[first + 16].item() == low[row, group].item()
    assert torch.count_nonzero(pairs[2, :, :, 5:]) == 0  # the last tile's padding
    back = cpu_native.unpack_int4_scales(pairs, 37)
    assert torch.equal(back[0], scale) and torch.equal(back[1], low + 8 * scale)


def test_int4_linear_declines_what_it_cannot_take():
    packed = torch.zeros(4, 32, dtype=torch.uint8)  # k = 64
    pairs = cpu_native.pack_int4_scales(torch.ones(4, 2), torch.ones(4, 2))
    x = torch.ones(1, 64)
    assert cpu_native.linear_int4_groups(x, packed, pairs.float()) is None  # float32
    assert cpu_native.linear_int4_groups(x, packed, torch.ones(4, 4).half()) is None  # not pairs
    assert cpu_native.linear_int4_groups(x, packed, torch.ones(2, 2, 2, 16).half()) is None  # tiles
    assert cpu_native.linear_int4_groups(torch.ones(1, 32), packed, pairs) is None  # k
    assert cpu_native.linear_int4_groups(x, packed[:, ::2], pairs[:, :1]) is None


def make_layer(quant: WeightQuant, out_features: int = 40, in_features: int = 256):
    layer = QuantizedLinear(in_features, out_features, True, quant)
    g = torch.Generator().manual_seed(out_features)
    layer.load_weight(torch.randn(out_features, in_features, generator=g) * 0.05)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(out_features, generator=g))
    return layer


def counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = cpu_native.linear_int4_groups
    monkeypatch.setattr(
        cpu_native, "linear_int4_groups", lambda *a: calls.append(a[0].shape[0]) or original(*a)
    )
    return calls


@needs_kernel
@pytest.mark.parametrize("group", [32, 128])
def test_int4_layer_with_fp32_activations_reads_its_codes_natively(group, monkeypatch):
    layer = make_layer(WeightQuant("int4", group))
    assert layer.int4_layout == "native"  # built in the kernel's layout at load, no second copy
    calls = counting(monkeypatch)
    x = torch.randn(2, 3, 256)
    got = layer(x)
    assert calls == [6]
    want = F.linear(x, layer.dequantize(), layer.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    big = torch.randn(300, 256)  # more rows than NATIVE_ROWS: dequantize + F.linear
    torch.testing.assert_close(layer(big), F.linear(big, layer.dequantize(), layer.bias))
    assert calls == [6]


@needs_kernel
def test_int4_layer_falls_back_when_the_kernel_declines(monkeypatch):
    layer = make_layer(WeightQuant("int4", 64))
    monkeypatch.setattr(cpu_native, "enabled", False)
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize(), layer.bias))


@needs_kernel
def test_bfloat16_activations_keep_atens_packed_matmul(monkeypatch):
    layer = make_layer(WeightQuant("int4", 32), out_features=48)  # ATen packs 16 rows at a time
    weight, codes = layer.dequantize(), layer.int4_codes()
    layer.to(torch.bfloat16)
    calls = counting(monkeypatch)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    got = layer(x)
    assert calls == [] and layer.int4_layout == "aten"  # repacked in place for ATen's kernel
    assert torch.equal(layer.int4_codes(), codes)
    want = F.linear(x.float(), weight.bfloat16().float(), layer.bias.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@needs_kernel
def test_a_bfloat16_layer_loads_in_atens_layout():
    layer = QuantizedLinear(64, 16, False, WeightQuant("int4", 32)).to(torch.bfloat16)
    codes, scale, zero, _ = make_weights(16, 64, 32)
    layer.load_int4(codes, scale, zero)
    assert layer.int4_layout == "aten" and torch.equal(layer.int4_codes(), codes.int())


@needs_kernel
@pytest.mark.parametrize(("n", "group"), [(37, 32), (48, 128), (16, 256)])  # a last tile of 5
def test_the_native_dequantized_copy_equals_torchs_q_times_scale_plus_low(n, group, monkeypatch):
    codes, scale, zero, _ = make_weights(n, 256, group, seed=n)
    packed, pairs = cpu_native.pack_int4(codes), cpu_native.pack_int4_scales(scale, zero)
    native = cpu_dequant.dequantize_int4(packed, pairs, 256)
    low = (zero - 8 * scale).view(n, -1, 1)  # the layout's float16 minimums, exactly
    want = (codes.float().view(n, -1, group) * scale[..., None] + low).view(n, 256)
    assert torch.equal(native, want)
    monkeypatch.setattr(cpu_native, "enabled", False)
    assert torch.equal(cpu_dequant.dequantize_int4(packed, pairs, 256), want)  # torch's ops
