"""`kernels/reference.py` is the oracle for every kernel; here it is checked against plain dense
attention written out with matmul/softmax on contiguous tensors, through shuffled block tables."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference


def dense_causal_attention(q, k, v, scale, window=None, softcap=None):
    """q [n, Hq, D] are the last n positions of k, v [L, Hkv, D]; logits soft-capped to
    softcap * tanh(logit / softcap) before the mask (Gemma 2) when `softcap` is given."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(L - n, L)[:, None]
    k_pos = torch.arange(L)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("scale", "softcap"), [(8**-0.5, None), (0.9, 1.5)], ids=["", "capped"])
def test_varlen_paged_attention_equals_dense(block_size, heads, kv_heads, window, scale, softcap):
    g = torch.Generator().manual_seed(block_size * 100 + heads * 10 + kv_heads)
    D = 8
    lens, q_lens = [1, 9, 16, 23], [1, 3, 16, 1]  # a new prompt, a chunk, a full prefill, decode
    # one flattened batch over one pool, blocks scattered in random order
    pool_k = torch.zeros(256, block_size, kv_heads, D)
    pool_v = torch.zeros_like(pool_k)
    free = torch.randperm(256, generator=g).tolist()
    rows, flat_q, want_all, uncapped = [], [], [], []
    for L, n in zip(lens, q_lens, strict=True):
        k = torch.randn(L, kv_heads, D, generator=g)
        v = torch.randn(L, kv_heads, D, generator=g)
        q = torch.randn(n, heads, D, generator=g)
        blocks = [free.pop() for _ in range(-(-L // block_size))]
        slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(L)]
        )
        reference.write_kv(pool_k, pool_v, k, v, slots)
        rows.append(blocks)
        flat_q.append(q)
        want_all.append(dense_causal_attention(q, k, v, scale, window, softcap))
        uncapped.append(dense_causal_attention(q, k, v, scale, window))
    width = max(map(len, rows))
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    got = reference.paged_attention(
        torch.cat(flat_q), pool_k, pool_v, tables, q_lens, lens, scale, window, softcap
    )
    torch.testing.assert_close(got, torch.cat(want_all), atol=1e-5, rtol=1e-5)
    if softcap is not None:  # the cap acts on these logits (up to ~4)
        assert (got - torch.cat(uncapped)).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcapped_reference_is_transformers_gemma2_eager_attention(dtype):
    """The order of operations transformers runs Gemma 2's capped attention in (eager: logits
    scaled, divided by the cap, tanh, times the cap, masked, float32 softmax rounded to the
    dtype, times V), GQA and a sliding window included: bf16 rounds at the same steps."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(4)
    L, n, heads, kv_heads, D, window, scale, cap = 24, 5, 8, 2, 32, 9, 0.3, 2.5
    q = torch.randn(n, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(L, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    got = reference.sequence_attention(q, k, v, scale, window, cap)
    q_pos, k_pos = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
    mask = torch.zeros(n, L, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)
    want, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        mask[None, None], scaling=scale, softcap=cap,
    )  # fmt: skip
    # NOTE: the same products per head (a batched GEMM of the same shapes): equal bit for bit
    assert torch.equal(got, want[0])


def test_a_softcap_far_above_the_logits_is_plain_sdpa():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(6, 4, 16, generator=g), *torch.randn(2, 20, 2, 16, generator=g)
    for window in (None, 7):
        capped = reference.sequence_attention(q, k, v, 0.25, window, softcap=1e5)
        torch.testing.assert_close(capped, reference.sequence_attention(q, k, v, 0.25, window))


def test_a_block_shared_by_two_sequences_is_read_by_both():
    g = torch.Generator().manual_seed(0)
    bs, H, D = 4, 2, 8
    k = torch.randn(7, H, D, generator=g)
    v = torch.randn(7, H, D, generator=g)
    pool_k, pool_v = torch.zeros(8, bs, H, D), torch.zeros(8, bs, H, D)
    # sequence A = blocks [5, 2], sequence B shares block 5 then owns block 6
    reference.write_kv(pool_k, pool_v, k[:4], v[:4], torch.arange(20, 24))
    reference.write_kv(pool_k, pool_v, k[4:7], v[4:7], torch.arange(8, 11))
    k_b_tail, v_b_tail = torch.randn(2, H, D, generator=g), torch.randn(2, H, D, generator=g)
    reference.write_kv(pool_k, pool_v, k_b_tail, v_b_tail, torch.arange(24, 26))
    q = torch.randn(2, H, D, generator=g)
    tables = torch.tensor([[5, 2], [5, 6]])
    got = reference.paged_decode_attention(q, pool_k, pool_v, tables, [7, 6], 0.5)
    want_a = dense_causal_attention(q[:1], k, v, 0.5)
    want_b = dense_causal_attention(
        q[1:], torch.cat([k[:4], k_b_tail]), torch.cat([v[:4], v_b_tail]), 0.5
    )
    torch.testing.assert_close(got, torch.cat([want_a, want_b]), atol=1e-5, rtol=1e-5)


def test_copy_and_swap_blocks_move_whole_pages():
    cache = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)
    reference.copy_blocks(cache, [(1, 4), (2, 5)])
    assert cache[4].tolist() == cache[1].tolist() and cache[5].tolist() == cache[2].tolist()
    host = torch.zeros(4, 3)
    reference.swap_blocks(cache, host, [(0, 3), (5, 1)])
    assert host.tolist() == [[0, 0, 0], cache[5].tolist(), [0, 0, 0], cache[0].tolist()]
