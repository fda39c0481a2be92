from __future__ import annotations

import pytest

from pagedserve.cli_options import parse_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9), ("1.5gib", 3 * 2**29)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "12 parsecs", "-5", "MiB"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)
