"""Fixtures of the real-model tests (see tests/support/smollm2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import smollm2


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The fp32 Hugging Face directory of SmolLM2-135M-Instruct, converted once per machine."""
    return smollm2.smollm2_dir()
