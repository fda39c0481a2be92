"""Settings that load and run but slowly on this host are named in a warning at load
(model/loader.py `_warn_if_slow`), so an operator sees the faster choice."""

from __future__ import annotations

import logging

import pytest

from pagedserve.kernels import cpu_native
from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.quant import WeightQuant

AVX2_EPYC = "fpu sse2 avx fma avx2 bmi2"  # no AVX-512, no bf16 arithmetic
SAPPHIRE_RAPIDS = "fpu sse2 avx fma avx2 avx512f avx512_bf16 amx_bf16 amx_tile"


def warnings_at_load(caplog, **config) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.model.loader"):
        load_model(load_model_config(**config))
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(("flags", "warned"), [(AVX2_EPYC, True), (SAPPHIRE_RAPIDS, False)])
def test_bf16_on_a_cpu_that_emulates_it_is_named_with_the_faster_dtype(
    tiny_llama, caplog, monkeypatch, flags, warned
):
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: flags)
    said = warnings_at_load(caplog, model_dir=tiny_llama, dtype="bfloat16")
    assert any("--dtype float32" in m for m in said) is warned
    assert not warnings_at_load(caplog, model_dir=tiny_llama, dtype="float32")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fp32_activations_over_quantized_weights_are_slow_only_without_the_native_kernels(
    tiny_llama, caplog, monkeypatch, method
):
    config = dict(model_dir=tiny_llama, dtype="float32", quantization=WeightQuant(method))
    if cpu_native.build_blocker() is None:  # the kernels read the codes: nothing to warn about
        assert not any("packed kernels" in m for m in warnings_at_load(caplog, **config))
    monkeypatch.setattr(cpu_native, "unavailable_reason", lambda: "no C compiler (cc) on PATH")
    said = warnings_at_load(caplog, **config)
    assert any("no C compiler" in m and "--dtype bfloat16 uses the packed kernels" in m
               for m in said)  # fmt: skip
