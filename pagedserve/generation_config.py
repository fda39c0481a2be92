"""What a model directory's `generation_config.json` says about generation (torch-free: the router
and the workers read it alike).

- eos: a model stops on every eos id of `config.json` **and** of `generation_config.json` (which
  often lists several: Llama-3 Instruct has three; chat models end a turn with one that
  `config.json` does not name).
- sampling defaults: `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` written
  there apply to a request that leaves that field unset, as vLLM's `--generation-config auto`
  does; `--generation-config none` falls back to SamplingParams' own defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "generation_config.json"

SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""Fields of generation_config.json that become request defaults (their names agree with ours)."""


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json as written, `{}` when the model has none."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"model: {path} is not a JSON object")
    return value


def eos_token_ids(config: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """Every eos id of config.json then of generation_config.json, each once, in that order."""
    ids: list[int] = []
    for source in (config, generation):
        eos = source.get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def sampling_defaults(generation: dict[str, Any]) -> dict[str, float]:
    """The request defaults generation_config.json sets (`top_k` stays an int)."""
    defaults: dict[str, float] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        value = generation.get(name)
        if value is not None:
            defaults[name] = int(value) if name == "top_k" else float(value)
    return defaults
