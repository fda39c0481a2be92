"""The transformers oracle shared by every test that produces tokens.

`hf_greedy` runs Hugging Face `generate(do_sample=False)` one prompt at a time (no padding), so
its output is the reference for pagedserve's batched, paged paths.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.model.quant import WeightQuant, dequantize_into
from pagedserve.sampling_params import SamplingParams

PROMPT_LENS = (1, 7, 16, 17, 33, 64, 150, 300)
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def make_prompts(lens=PROMPT_LENS, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@cache
def hf_model(model_dir: Path, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@cache
def hf_dequantized(model_dir: Path, quant: WeightQuant):
    """transformers' fp32 model on the weights a quantized pagedserve model computes with."""
    return dequantize_into(AutoModelForCausalLM.from_pretrained(model_dir).eval(), quant)


def hf_greedy_on(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@cache
def hf_greedy(model_dir: Path, dtype: torch.dtype, prompt: tuple[int, ...]):
    """(new token ids, per-step logits [steps, vocab] float32) from transformers."""
    model = hf_model(model_dir, dtype)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float()


def make_engine(model_dir: Path, **config) -> DecodeEngine:
    """The decode engine, in-process, without a swap space unless `config` asks for one."""
    config.setdefault("num_swap_blocks", 0)
    return DecodeEngine.from_model_dir(str(model_dir), DecodeEngineConfig(**config))


def run_engine(model_dir: Path, prompts, *, record_logits=False, **config):
    engine = make_engine(model_dir, **config)
    engine.record_logits = record_logits
    seqs = engine.generate(prompts, GREEDY)
    engine.check_integrity()
    assert engine.pool.num_used == 0, "finished sequences must hold no blocks"
    assert engine.runner.sampler.num_generators == 0, "finished sequences hold no generator"
    return engine, seqs


def hf_beams(
    model_dir: Path,
    tokens: list[int],
    k: int,
    new: int,
    length_penalty: float,
    n: int,
    stop: tuple[int, ...] = (),
):
    """transformers' beams: `generate(num_beams=k, do_sample=False)`, the default
    `early_stopping=False`; `stop` token ids end a beam like eos does."""
    model = hf_model(model_dir, torch.float32)
    eos = [model.generation_config.eos_token_id, *stop]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([tokens]),
            max_new_tokens=new,
            num_beams=k,
            num_return_sequences=n,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=False,
            eos_token_id=eos,
        )
    outs = []
    for row in out[:, len(tokens) :].tolist():
        # NOTE: shorter beams are padded after their eos; cut there
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        outs.append(row[:cut])
    return outs
