"""The transformers oracle shared by every test that produces tokens.

`hf_greedy` runs Hugging Face `generate(do_sample=False)` one prompt at a time (no padding), so
its output is the reference for pagedserve's batched, paged paths.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.kernels import kv_quant
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


def assert_swap_keeps_transformers_tokens(model_dir: Path, prompts, num_blocks: int) -> None:
    """Prefill chunks of 32 tokens beside decodes, blocks of 8, and a KV pool of `num_blocks`
    too small for every sequence at once: sequences are swapped out and back in (at least one,
    asserted), the pool's integrity holds after every step, and every token equals
    transformers'."""
    engine = make_engine(
        model_dir, block_size=8, num_blocks=num_blocks, num_swap_blocks=64,
        max_num_batched_tokens=32, preemption_mode=PreemptionMode.SWAP,
    )  # fmt: skip
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    swapped = 0
    while engine.has_unfinished:
        swapped += len(engine.step().plan.preempted)
        engine.check_integrity()
    engine.close()
    assert swapped >= 1, "the pool must run short"
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, torch.float32, tuple(prompt))[0]


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


class _Kv8Layer(DynamicLayer):
    """transformers' cache layer with an 8-bit page store behind it: every new K/V token is
    written with the engine's rule (kernels/kv_quant.py, torch path, blocks of `block_size`
    in position order) and attention gets the dequantized values of the whole context, as
    the engine's attention reads its 8-bit pages."""

    def __init__(self, dtype: torch.dtype, block_size: int) -> None:
        super().__init__()
        self.code_dtype, self.block_size = dtype, block_size

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            heads, dim = key_states.shape[1], key_states.shape[3]
            blocks = 512
            self.pages = [
                (torch.zeros(blocks, self.block_size, heads, dim, dtype=self.code_dtype),
                 torch.zeros(blocks, heads))
                for _ in range(2)
            ]  # fmt: skip
            self.length = 0
        new = key_states.shape[2]
        slots = torch.arange(self.length, self.length + new)
        self.length += new
        used = torch.arange(-(-self.length // self.block_size))
        out = []
        for (codes, scales), states in zip(self.pages, (key_states, value_states), strict=True):
            kv_quant.write_kv(codes, scales, states[0].transpose(0, 1), slots)
            dense = kv_quant.dequantize_blocks(codes, scales, used, states.dtype)
            out.append(dense.flatten(0, 1)[: self.length].transpose(0, 1)[None])
        self.keys, self.values = out
        return self.keys, self.values


def hf_greedy_kv8(
    model_dir: Path, prompt: list[int], new_tokens: int, kv_dtype: torch.dtype, block_size: int
) -> list[int]:
    """transformers' greedy tokens with an 8-bit KV cache written as the engine writes it."""
    model = hf_model(model_dir, torch.float32)
    cache = DynamicCache(config=model.config)
    cache.layers = [_Kv8Layer(kv_dtype, block_size) for _ in cache.layers]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            cache=cache,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()
