"""Swapper ordering rules and SwapSpace sizing, on CPU (a copy thread)."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedserve.decode_worker.plan import SwapCopies, SwapDirection
from pagedserve.decode_worker.swapper import Swapper
from pagedserve.kernels.dispatch import swap_blocks
from pagedserve.kvstore.kv_cache import KVCacheSpec
from pagedserve.kvstore.swap_space import SwapSpace, swap_blocks_for

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


def pages(num_blocks: int, start: float = 0.0) -> torch.Tensor:
    shape = (num_blocks, 2, 2, 4, 2, 4)
    block = torch.arange(num_blocks, dtype=torch.float32) + start
    return block.view(-1, 1, 1, 1, 1, 1).expand(shape).contiguous()


class GatedCopy:
    """A copy that waits for `gate` before copying: a swap still in flight, on demand."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[list[tuple[int, int]]] = []

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, pairs) -> None:
        if pairs:
            assert self.gate.wait(timeout=10), "test forgot to open the gate"
        self.calls.append(list(pairs))
        swap_blocks(src, dst, list(pairs))


def test_write_to_a_block_a_pending_swap_out_reads_waits_for_the_copy():
    device, host = pages(6), torch.zeros(4, 2, 2, 4, 2, 4)
    copy = GatedCopy()
    swapper = Swapper(device, host, copy_fn=copy)
    swapper.submit(swap_in=[], swap_out=[(4, 0), (5, 1)])

    assert swapper.wait_for_writes({0, 1, 2}) is False  # disjoint: the copy keeps running
    assert swapper.num_pending == 1

    threading.Timer(0.05, copy.gate.set).start()
    assert swapper.wait_for_writes({5}) is True
    device[5].fill_(-1.0)  # the step's write, after the copy
    assert host[0].eq(4.0).all() and host[1].eq(5.0).all()
    assert swapper.num_pending == 0 and swapper.stats.num_waits_for_swap_out == 1
    swapper.close()


def test_swap_ins_run_before_swap_outs_and_jobs_in_submission_order():
    device, host = pages(4), pages(3, start=100.0)
    copy = GatedCopy()
    swapper = Swapper(device, host, copy_fn=copy)
    # step 1 swaps device 3 out to host 0; step 2 brings host 0 back into device 1 and reuses
    # device 3's id for host 2, and in the same job swaps device 1 (just swapped in) out to 1
    swapper.submit(swap_in=[], swap_out=[(3, 0)])
    swapper.submit(swap_in=[(0, 1), (2, 3)], swap_out=[(1, 1)])
    copy.gate.set()
    swapper.wait_swap_in()
    swapper.synchronize()
    assert copy.calls == [[(3, 0)], [(0, 1), (2, 3)], [(1, 1)]]
    assert device[1].eq(3.0).all() and device[3].eq(102.0).all()
    assert host[1].eq(3.0).all()
    assert swapper.stats.num_blocks_in == 2 and swapper.stats.num_blocks_out == 2
    assert swapper.stats.num_bytes_out == 2 * SPEC.bytes_per_block
    swapper.close()


def test_a_plan_s_copies_run_in_decision_order():
    device, host = pages(4), pages(3, start=100.0)
    copy = GatedCopy()
    copy.gate.set()
    swapper = Swapper(device, host, copy_fn=copy)
    # a victim's device block 3 goes out to host 0, then a swap-in fills the freed block 3
    # from host 2 and frees host 2, which a later swap-out (device 1) fills
    swapper.submit_plan(
        [
            SwapCopies(SwapDirection.OUT, [(3, 0)]),
            SwapCopies(SwapDirection.IN, [(2, 3)]),
            SwapCopies(SwapDirection.OUT, [(1, 2)]),
        ]
    )
    swapper.wait_swap_in()
    swapper.synchronize()
    assert copy.calls == [[(3, 0)], [(2, 3)], [(1, 2)]]
    assert host[0].eq(3.0).all() and device[3].eq(102.0).all() and host[2].eq(1.0).all()
    assert swapper.stats.num_blocks_in == 1 and swapper.stats.num_blocks_out == 2
    swapper.close()


def test_a_failed_copy_reraises_in_the_waiter():
    def broken(src, dst, pairs):
        if pairs:
            raise OSError("copy failed")

    swapper = Swapper(pages(2), torch.zeros(2, 2, 2, 4, 2, 4), copy_fn=broken)
    swapper.submit(swap_in=[(0, 0)], swap_out=[])
    with pytest.raises(OSError, match="copy failed"):
        swapper.wait_swap_in()


def test_swapper_refuses_mismatched_pages():
    with pytest.raises(ValueError, match="host_cache"):
        Swapper(pages(2), torch.zeros(2, 2, 2, 4, 2, 2))


def test_swap_space_size_in_gib_and_integrity():
    assert SPEC.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4
    assert swap_blocks_for(SPEC, 1 / 1024) == (1 << 20) // SPEC.bytes_per_block
    assert SwapSpace.from_gib(SPEC, 0) is None
    space = SwapSpace.from_gib(SPEC, 1 / 1024)
    assert space is not None and space.num_blocks == 2048 and not space.is_pinned
    assert space.tensor.shape == (2048, 2, 2, 4, 2, 4)
    ids = space.allocate(3)
    assert ids == [0, 1, 2] and space.num_free == 2045
    space.check_integrity()
    space.free(ids)
    space.check_integrity()
    assert space.allocate(4096) is None
    with pytest.raises(ValueError, match="swap_space_gib"):
        swap_blocks_for(SPEC, -1)
