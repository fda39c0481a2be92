"""Shared fixtures: tiny models built once per session, the session's clusters, real
redis-servers, and the block-pool integrity guard."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# NOTE: Triton picks interpreter or compiler once, when triton.language is first imported; a test
# module that imports transformers (or the kernels) before tests/kernels/conftest.py sets this
# would leave `tl.cdiv` & co. compiled-only, and every interpreted kernel would fail. So: first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from support.chat_templates import CHATML, model_with_template
from support.clusters import Clusters
from support.redis_server import RedisServer, running_redis

from pagedserve.kvstore.block_pool import BlockPool


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server for one test."""
    with running_redis(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server shared by one test module."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(autouse=True)
def _check_every_block_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """After every test, every BlockPool the test created must pass `check_integrity()`."""
    pools: weakref.WeakSet[BlockPool] = weakref.WeakSet()
    original_init = BlockPool.__init__

    def tracking_init(self: BlockPool, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)  # type: ignore[arg-type]
        pools.add(self)

    monkeypatch.setattr(BlockPool, "__init__", tracking_init)
    yield
    for pool in list(pools):
        pool.check_integrity()


_TINY_CACHE: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory):
    """`make_tiny(arch="llama", **kwargs) -> Path`: a tiny model dir, built once per arguments."""

    def build(arch: str = "llama", **kwargs: object) -> Path:
        from pagedserve.tiny_model import make_tiny_model

        key = (arch, repr(sorted(kwargs.items())))
        if key not in _TINY_CACHE:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            _TINY_CACHE[key] = make_tiny_model(out, arch=arch, **kwargs)  # type: ignore[arg-type]
        return _TINY_CACHE[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(make_tiny) -> Path:
    return make_tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen3(make_tiny) -> Path:
    """`Qwen3ForCausalLM`: q/k norms, head_dim 32 (not hidden / heads = 16), no biases."""
    return make_tiny("qwen3")


# A tiny Phi-3 with longrope: short and long factors of rotary_dim / 2 = 6 distinct values, an
# original context of 64 within max_position_embeddings 256 (attention factor sqrt(1 + ln 4 /
# ln 64), not 1)
PHI3_LONGROPE = {
    "rope_type": "longrope", "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.37 * i for i in range(6)],
    "long_factor": [3.0 + 1.5 * i for i in range(6)],
}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_phi3(make_tiny) -> Path:
    """`Phi3ForCausalLM`: fused qkv_proj / gate_up_proj in the checkpoint, rope over 12 of each
    head's 16 dims (partial_rotary_factor 0.75, Phi-4-mini's)."""
    return make_tiny("phi3")


@pytest.fixture(scope="session")
def tiny_phi3_longrope(make_tiny) -> Path:
    """The tiny Phi-3 with `PHI3_LONGROPE` (original_max_position_embeddings 64)."""
    return make_tiny("phi3", max_position_embeddings=256, rope_scaling=PHI3_LONGROPE)


@pytest.fixture(scope="session")
def tiny_mixtral(make_tiny) -> Path:
    """`MixtralForCausalLM`: 8 experts, 2 per token, in both layers."""
    return make_tiny("mixtral")


@pytest.fixture(scope="session")
def tiny_qwen2_moe(make_tiny) -> Path:
    """`Qwen2MoeForCausalLM`: 8 experts, 2 per token (not renormalised), a gated shared
    expert, qkv biases."""
    return make_tiny("qwen2_moe")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(make_tiny) -> Path:
    """`Qwen3MoeForCausalLM`: q/k norms, 8 experts, 2 per token, in layer 0; layer 1 dense."""
    return make_tiny("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_gemma2(make_tiny) -> Path:
    """`Gemma2ForCausalLM`: Gemma's layer, window 12 on layer 0, attention and final-logit
    soft-caps of 5 and 3 (pagedserve/tiny_model.py)."""
    return make_tiny("gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3(make_tiny) -> Path:
    """`Gemma3ForCausalLM`: Gemma's layer with q/k norms, window 12 on layer 0, a local rope
    for it and a linearly scaled global rope for layer 1 (pagedserve/tiny_model.py)."""
    return make_tiny("gemma3")


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with the ChatML chat template (one directory for the session, so that the
    clusters of every test that serves it can be one)."""
    return model_with_template(tiny_llama, tmp_path_factory.mktemp("tiny-chat") / "model", CHATML)


@pytest.fixture(scope="session")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    """The session's cluster factory (tests/support/clusters.py): `clusters.get(model, **flags)`
    shares one running cluster per configuration; `clusters.private(...)` gives a fresh one.
    Every shared cluster is stopped, and checked, at the end of the session."""
    factory = Clusters(tmp_path_factory.mktemp("clusters"))
    yield factory
    factory.close()
