"""/proc lookups shared by the tests that run real processes."""

from __future__ import annotations

import pathlib


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
