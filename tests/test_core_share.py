"""`CoreShare`: workers of one host lend each other their cores through a small shared file;
`one_torch_thread` keeps side threads off the engine loop's OpenMP team."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pagedserve import core_share
from pagedserve.core_share import CoreShare, one_torch_thread, open_core_share, parse_spec


def _share(path, slot, cores=4, borrow=True):
    calls: list[int] = []
    return CoreShare(path, slot, cores=cores, set_threads=calls.append, borrow=borrow), calls


def test_busy_workers_split_the_cores_and_an_idle_one_lends_them(tmp_path):
    path = tmp_path / "share"
    core_share.create(path, 2)
    decode, decode_calls = _share(path, 0)
    prefill, prefill_calls = _share(path, 1)
    assert decode.busy() == 4, "alone: every core"
    assert prefill.busy() == 2, "both busy: half each"
    assert decode.busy() == 2
    prefill.idle()
    assert decode.busy() == 4, "the other went idle: its cores come back"
    assert decode_calls == [4, 2, 4], "torch's count is set only when it changes"
    assert prefill_calls == [2]
    decode.busy()
    assert decode_calls == [4, 2, 4]


def test_a_worker_that_does_not_borrow_keeps_its_share(tmp_path):
    path = tmp_path / "share"
    core_share.create(path, 2)
    prefill, _ = _share(path, 1, borrow=False)
    assert prefill.busy() == 2, "the other worker idle: still cores // workers"
    decode, _ = _share(path, 0)
    assert decode.busy() == 2
    assert prefill.busy() == 2


def test_a_dead_busy_worker_lends_its_cores(tmp_path):
    path = tmp_path / "share"
    core_share.create(path, 2)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    dead_pid = int(child.stdout)
    data = bytearray(path.read_bytes())
    core_share._SLOT.pack_into(data, 0, dead_pid, 1)  # slot 0: busy, but its process is gone
    path.write_bytes(bytes(data))
    me, _ = _share(path, 1)
    assert me.busy_workers() == 0, "the dead worker's busy slot does not count"
    assert me.busy() == 4
    assert me.busy_workers() == 1


def test_spec_and_slot_errors_name_the_flag(tmp_path):
    assert parse_spec("/run/share:3") == (Path("/run/share"), 3)
    for bad in ("/run/share", "/run/share:x", ":1"):
        with pytest.raises(ValueError, match="core-share"):
            parse_spec(bad)
    path = tmp_path / "share"
    core_share.create(path, 2)
    with pytest.raises(ValueError, match="core-share: slot 2"):
        CoreShare(path, 2, set_threads=lambda n: None)
    assert open_core_share(None) is None
    share = open_core_share(f"{path}:1", borrow=False)
    assert share is not None and share.slot == 1 and not share.borrow
    share.close()


def test_one_torch_thread_leaves_the_engine_threads_count_alone():
    before = torch.get_num_threads()
    seen: list[int] = []

    def side() -> None:
        one_torch_thread()
        torch.ones(64, 64).sum()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=side)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == before, "the calling thread's count is its own"
