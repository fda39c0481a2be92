"""`--model FILE.gguf` for every family transformers' GGUF reader knows, on files written by
llama.cpp's own converter (`convert_hf_to_gguf.py`, from `make gguf-converter`), as downloaded
GGUF files are: each family's tiny checkpoint is converted to an F32 GGUF, `fetch_model` reads
it back (pagedserve/gguf_families.py corrects what transformers' reader gets wrong), and the
engine's greedy tokens and fp32 logits on it equal transformers' on the ORIGINAL safetensors.
A Q8_0 file from the same converter loads from its blocks under `--quantization int8` for the
families that take it. Phi-3's file with longrope factors (Phi-3.5, Phi-4-mini) is read too.
OLMo 2 and Granite GGUF files stay refused (test_olmo2_granite.py): transformers' reader has no
mapping for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.oracle import hf_greedy, hf_greedy_on, hf_model, make_prompts, run_engine

from pagedserve.fetch_model import fetch_model, gguf_architecture
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import QuantizedLinear, WeightQuant

ROOT = Path(__file__).resolve().parents[2]
CONVERTER = Path(
    os.environ.get("PAGEDSERVE_GGUF_CONVERTER") or ROOT / ".cache" / "llama-cpp-converter"
)
DRIVER = ROOT / "tests" / "support" / "llama_cpp_convert.py"
_GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
_GEMMA3_ROPES = {  # NOTE: a local base other than the default 10000, so that it must be read
    "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
}
# family: (make_tiny arch, its arguments, the GGUF's general.architecture). NOTE: where the
# tiny checkpoint has what no llama.cpp GGUF can say, it is built as real checkpoints are:
# Gemma's attention scale 1 / sqrt(head_dim) (llama.cpp does not store query_pre_attn_scalar);
# Gemma 2 tied (llama.cpp drops its lm_head); Gemma 3 six layers, five sliding then a full one
# (llama.cpp's default pattern, so the full layer and its scaled rope are there); Qwen3-MoE
# experts in every layer (llama.cpp maps no `mlp_only_layers`). Qwen2's embedding has 520 rows:
# transformers 5 loads its tokenizer as Qwen2Tokenizer, which adds <|endoftext|> as id 512, and
# llama.cpp's converter wants every token id below vocab_size (released Qwen2 pads it too).
FAMILIES = {
    "qwen3": ("qwen3", {}, "qwen3"),
    "gemma2": ("gemma2", {"tie_word_embeddings": True,
                          "config_overrides": {"query_pre_attn_scalar": 32}}, "gemma2"),
    "gemma3": ("gemma3", {"layers": 6, "config_overrides": {
        "query_pre_attn_scalar": 32, "layer_types": _GEMMA3_LAYERS,
        "rope_parameters": _GEMMA3_ROPES}}, "gemma3"),
    "phi3": ("phi3", {}, "phi3"),
    "phi3_longrope": ("phi3", {}, "phi3"),  # NOTE: the conftest fixture tiny_phi3_longrope
    "qwen2_moe": ("qwen2_moe", {}, "qwen2moe"),
    "qwen3_moe": ("qwen3_moe", {"config_overrides": {"mlp_only_layers": []}}, "qwen3moe"),
    "mixtral": ("mixtral", {}, "llama"),
    "llama": ("llama", {}, "llama"),
    "mistral": ("mistral", {}, "llama"),
    "qwen2": ("qwen2", {"config_overrides": {"vocab_size": 520}}, "qwen2"),
}  # fmt: skip
# NOTE: longrope is served within its original context only (test_phi3.py)
ENGINE_ARGS = {"phi3_longrope": {"max_model_len": 64}}
Q8_0_FAMILIES = ("qwen3", "gemma2", "gemma3", "llama", "qwen2")  # --quantization takes these


def llama_cpp_convert(jobs: list[tuple[Path, Path, str]]) -> None:
    """Each (checkpoint, out.gguf, outtype) as llama.cpp's converter writes it, all in one
    process (tests/support/llama_cpp_convert.py)."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"no llama.cpp converter in {CONVERTER}: run `make gguf-converter`")
    argv = [sys.executable, str(DRIVER), str(CONVERTER)]
    argv += [str(part) for job in jobs for part in job]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="session")
def sources(make_tiny, tiny_phi3_longrope) -> dict[str, Path]:
    """{family: its tiny checkpoint}."""
    found = {family: make_tiny(arch, **kw) for family, (arch, kw, _) in FAMILIES.items()}
    return {**found, "phi3_longrope": tiny_phi3_longrope}


@pytest.fixture(scope="session")
def ggufs(sources, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """{(family, outtype): llama.cpp's GGUF of its tiny checkpoint}: every family in F32, the
    Q8_0_FAMILIES in Q8_0 too."""
    out = tmp_path_factory.mktemp("llama-cpp-gguf")
    wanted = [(f, "f32") for f in sources] + [(f, "q8_0") for f in Q8_0_FAMILIES]
    files = {(f, kind): out / f"{f}.{kind}.gguf" for f, kind in wanted}
    llama_cpp_convert([(sources[f], files[f, kind], kind) for f, kind in wanted])
    return files


@pytest.fixture(scope="session")
def converted(sources, ggufs):
    """`converted(family, outtype="f32") -> (tiny checkpoint, its GGUF, fetch_model's dir)`."""

    def get(family: str, outtype: str = "f32") -> tuple[Path, Path, Path]:
        gguf = ggufs[family, outtype]
        return sources[family], gguf, fetch_model(str(gguf), gguf.with_name(gguf.stem))

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_llama_cpp_gguf_serves_the_original_checkpoints_tokens_and_logits(converted, family):
    source, gguf, model_dir = converted(family)
    assert gguf_architecture(gguf) == FAMILIES[family][2]
    prompts = make_prompts((5, 23), seed=7)
    engine_args = ENGINE_ARGS.get(family, {})
    engine, seqs = run_engine(model_dir, prompts, record_logits=True, num_blocks=64, **engine_args)
    for prompt, seq in zip(prompts, seqs, strict=True):
        want_tokens, want_logits = hf_greedy(source, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        err = (torch.stack(engine.logits[seq.request_id]) - want_logits).abs().max().item()
        assert err < 1e-4, f"prompt of {len(prompt)}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("family", Q8_0_FAMILIES)
def test_a_llama_cpp_q8_0_gguf_loads_from_its_blocks_under_int8(converted, monkeypatch, family):
    """Every linear from the file's Q8_0 codes and scales (rows in transformers' order), equal to
    transformers' dequantization of the same file; the engine's greedy tokens equal transformers'
    on that dequantization."""
    _, _, model_dir = converted(family, "q8_0")
    quantized = []
    real = QuantizedLinear.load_weight
    monkeypatch.setattr(
        QuantizedLinear, "load_weight", lambda s, w: quantized.append(s) or real(s, w)
    )
    model = load_model(load_model_config(model_dir, None, WeightQuant("int8")))
    assert quantized == [], "a linear was quantized from the fp32 weights, not read from blocks"
    weights = load_file(str(model_dir / "model.safetensors"))
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) >= 7 * model.config.num_layers and all(m.int8_groups for _, m in linears)
    for name, layer in linears:
        if f"{name}.weight" in weights:
            assert torch.equal(layer.dequantize(), weights[f"{name}.weight"]), name
    prompts = make_prompts((19,), seed=3)
    _, seqs = run_engine(model_dir, prompts, num_blocks=64, quantization=WeightQuant("int8"))
    hf = hf_model(model_dir, torch.float32)
    assert [s.output_token_ids for s in seqs] == [hf_greedy_on(hf, p) for p in prompts]
