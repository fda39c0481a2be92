"""The `pagedserve` command line, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def pagedserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def generate_matches_transformers(model_dir) -> None:
    """`pagedserve generate --model DIR` (in-process) prints transformers' greedy text."""
    out = pagedserve(
        "generate", "--model", str(model_dir), "--prompt", "The oven", "--max-tokens", "8"
    )
    assert out.returncode == 0, out.stderr
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tokenizer("The oven", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert out.stdout.rstrip("\n") == tokenizer.decode(want, skip_special_tokens=True)


def test_make_tiny_model_then_generate_matches_transformers(tmp_path):
    model_dir = tmp_path / "tiny"
    made = pagedserve(
        "make-tiny-model", str(model_dir), "--layers", "1", "--hidden", "32", "--heads", "2",
        "--kv-heads", "1", "--vocab", "300", "--seed", "3",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        1,
        32,
        300,
    )

    generate_matches_transformers(model_dir)


@pytest.mark.parametrize(
    ("family", "architecture"),
    [("qwen3", "Qwen3ForCausalLM"), ("olmo2", "Olmo2ForCausalLM"),
     ("granite", "GraniteForCausalLM"), ("phi3", "Phi3ForCausalLM"),
     ("qwen2_moe", "Qwen2MoeForCausalLM"), ("gemma3", "Gemma3ForCausalLM")],
)  # fmt: skip
def test_make_tiny_model_makes_each_family(tmp_path, family, architecture):
    """NOTE: one family's model is also generated from here; every family's tokens equal
    transformers' through a cluster in tests/model/test_family_clusters.py (the CLI's
    `generate` adds nothing per family, and each run costs seconds of imports)."""
    model_dir = tmp_path / f"tiny-{family}"
    made = pagedserve("make-tiny-model", "--family", family, str(model_dir), "--layers", "1")
    assert made.returncode == 0, made.stderr
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [architecture]
    if family == "qwen3":
        assert config["head_dim"] == 32
    if family == "qwen2_moe":
        generate_matches_transformers(model_dir)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    out = pagedserve("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert out.returncode == 2
    assert "config.json" in out.stderr or "nope" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_tls_flags_of_the_client_commands_are_clear_errors(tmp_path):
    half = pagedserve("status", "--tls-client-cert", str(tmp_path / "client.crt"))
    assert half.returncode == 2
    assert "--tls-client-key" in half.stderr and "Traceback" not in half.stderr
    missing = pagedserve(
        "generate", "--router", "127.0.0.1:1", "x", "--tls-ca", str(tmp_path / "ca")
    )
    assert missing.returncode == 2
    assert str(tmp_path / "ca") in missing.stderr and "Traceback" not in missing.stderr


def test_the_cli_knows_every_benchmark_scenario():
    from pagedserve import cli
    from pagedserve.bench import suite

    assert set(cli._SCENARIOS) == set(suite.SCENARIOS)  # noqa: SLF001
