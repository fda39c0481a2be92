"""csrc/token_mask.c: a grammar's bitmask on logits gives what xgrammar's own kernel gives, for
the rows asked only, with a vocabulary that is not a multiple of 32."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from pagedserve.kernels import cpu_native

needs_kernel = pytest.mark.skipif(cpu_native.build_blocker() is not None, reason="no kernel")


@needs_kernel
@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_the_native_mask_is_xgrammars(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
    bitmask[1] = 0  # nothing allowed but what the grammar allows: all -inf
    bitmask[2] = -1  # everything allowed
    logits = torch.randn(6, vocab, generator=g)
    rows = [0, 1, 2, 4]
    ours, theirs = logits.clone(), logits.clone()
    assert cpu_native.mask_logits(ours, bitmask, rows)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[3, 5]], logits[[3, 5]])  # rows not asked for are untouched
    assert torch.isneginf(ours[1]).all() and torch.equal(ours[2], logits[2])
