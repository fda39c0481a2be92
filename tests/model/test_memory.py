"""Sizing the KV cache from the device's memory (`--kv-cache-memory-fraction`): the weights'
size computed from the config is the loaded model's, exactly, and the budget is the rest."""

from __future__ import annotations

import argparse
import gc
import os

import pytest
from support.oracle import make_engine

from pagedserve.cli_options import add_model_arguments
from pagedserve.kernels import mkl_packed, onednn_packed
from pagedserve.model import runner
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("olmo2", {}),
        ("granite", {}),
        ("gemma2", {}),
        ("gemma3", {}),
        ("mistral", {}),
        ("mixtral", {}),
        ("qwen2_moe", {}),
        ("qwen3_moe", {}),
        ("llama", {"tie_word_embeddings": True}),
    ],  # fmt: skip
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_are_the_loaded_models(make_tiny, arch, kwargs, dtype):
    config = load_model_config(make_tiny(arch, **kwargs), dtype)
    model = load_model(config)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert runner.weight_bytes(config) == loaded


def test_the_fraction_is_what_the_device_has_left_after_the_weights(tiny_llama, monkeypatch):
    config = load_model_config(tiny_llama, "float32")
    monkeypatch.setattr(runner, "device_memory_bytes", lambda device: 10 << 30)
    weights = runner.weight_bytes(config) + runner.packed_copy_bytes(config, "cpu")
    assert runner.kv_cache_bytes(config, "cpu", 123, None) == 123  # no fraction: the bytes
    assert runner.kv_cache_bytes(config, "cpu", 123, 0.5) == (5 << 30) - weights
    with pytest.raises(ValueError, match="kv-cache-memory-fraction"):
        runner.kv_cache_bytes(config, "cpu", 123, weights / (10 << 30) / 2)


def test_cpu_memory_is_the_smaller_of_ram_and_the_container_limit():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < runner.device_memory_bytes("cpu") <= physical


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1"])
def test_the_fraction_flag_is_in_zero_one(bad):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-memory-fraction", "0.9"])
    assert args.kv_cache_memory_fraction == 0.9
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-memory-fraction", bad])


def test_a_decode_worker_sizes_its_pool_from_the_fraction(tiny_llama, monkeypatch):
    from pagedserve.decode_worker.cli_args import add_arguments
    from pagedserve.decode_worker.server import engine_config
    from pagedserve.engine_sizing import size_engine

    monkeypatch.setattr(runner, "device_memory_bytes", lambda device: 1 << 30)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama), "--kv-cache-memory-fraction", "0.25"])
    config = load_model_config(tiny_llama, None)
    spec = runner.kv_cache_spec(config, args.block_size)
    budget = (1 << 28) - runner.weight_bytes(config) - runner.packed_copy_bytes(config, "cpu")
    assert engine_config(args, size_engine(args)).num_blocks == spec.num_blocks_for(budget)


@pytest.mark.parametrize(
    ("dtype", "packer", "size", "requests"),
    [  # MKL packs for products of more than 16 rows, oneDNN for up to 16
        pytest.param("float32", mkl_packed, 4, 20, marks=pytest.mark.skipif(
            not mkl_packed.available(), reason="torch here has no MKL: nothing is packed")),
        pytest.param("bfloat16", onednn_packed, 2, 4, marks=pytest.mark.skipif(
            not onednn_packed.available(), reason="no bf16 arithmetic here: nothing is packed")),
    ],
)  # fmt: skip
def test_the_packed_copies_are_counted_as_the_weights_they_copy(
    tiny_llama, dtype, packer, size, requests
):
    config = load_model_config(tiny_llama, dtype)
    gc.collect()
    before = set(packer.copies.weights())
    engine = make_engine(tiny_llama, block_size=8, num_blocks=128, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(requests):  # fp32: 100 prompt rows in a step, then 20 decoding (the head's)
        engine.add_request([3 + i] * 5, params)
    while engine.has_unfinished:
        engine.step()
    new = [w for key, w in packer.copies.weights().items() if key not in before]
    assert sum(w.numel() * size for w in new) == runner.packed_copy_bytes(config, "cpu") > 0
    assert runner.packed_copy_bytes(config, "cuda:0") == 0
    engine.close()
