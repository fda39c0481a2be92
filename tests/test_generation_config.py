"""generation_config.json: every eos id stops generation (workers and router), its sampling values
are the defaults of unset request fields (`--generation-config auto`, off with `none`), and the
router's max_model_len is the workers' `--max-model-len`."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import torch
from support.clusters import up_args
from support.oracle import hf_greedy, make_prompts

from pagedserve.client import Client
from pagedserve.generation_config import eos_token_ids, sampling_defaults
from pagedserve.launcher import start_cluster
from pagedserve.model.config import load_model_config
from pagedserve.router.convert import router_request
from pagedserve.router.tokenizer import RouterTokenizer, read_model_card
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, generation_pb2

CONFIG_EOS = 1  # what `make-tiny-model` writes into config.json


def write_generation_config(model_dir, **values) -> None:
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | values))


@pytest.fixture
def tiny_copy(make_tiny, tmp_path):
    """A private copy of the tiny model whose generation_config.json a test may rewrite."""
    return shutil.copytree(make_tiny("llama"), tmp_path / "tiny")


def test_eos_ids_are_config_then_generation_config_each_once():
    assert eos_token_ids({"eos_token_id": 2}, {"eos_token_id": [7, 2, 9]}) == (2, 7, 9)
    assert eos_token_ids({"eos_token_id": [3, 4]}, {}) == (3, 4)
    assert eos_token_ids({}, {"eos_token_id": 5}) == (5,)
    assert eos_token_ids({"eos_token_id": None}, {}) == ()


def test_sampling_defaults_are_the_generation_config_fields_we_know():
    generation = {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0, "do_sample": True,
                  "repetition_penalty": 1.1, "max_length": 77, "min_p": None}  # fmt: skip
    defaults = sampling_defaults(generation)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert isinstance(defaults["top_k"], int)


def test_workers_model_config_lists_every_eos_id(tiny_copy):
    write_generation_config(tiny_copy, eos_token_id=[CONFIG_EOS, 300, 301])
    assert load_model_config(tiny_copy).eos_token_ids == (CONFIG_EOS, 300, 301)


def test_unset_request_fields_take_generation_config_defaults(tiny_copy):
    write_generation_config(tiny_copy, temperature=0.6, top_p=0.9, top_k=20)
    card = read_model_card(tiny_copy)
    tokenizer = RouterTokenizer.from_model_dir(tiny_copy)
    msg = generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 6, 7]))
    msg.sampling.top_p = 0.5
    params = router_request(msg, tokenizer, card).params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)
    assert params.repetition_penalty == SamplingParams().repetition_penalty
    off = read_model_card(tiny_copy, use_generation_config=False)
    params = router_request(msg, tokenizer, off).params
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.5, 0)


def test_invalid_generation_config_defaults_fail_at_start(tiny_copy):
    write_generation_config(tiny_copy, top_p=1.5)
    with pytest.raises(ValueError, match="generation_config.json.*top_p"):
        read_model_card(tiny_copy)
    assert read_model_card(tiny_copy, use_generation_config=False).sampling_defaults == {}


def test_router_max_model_len_is_the_workers_flag(tiny_copy):
    assert read_model_card(tiny_copy).max_model_len == 2048  # max_position_embeddings
    assert read_model_card(tiny_copy, max_model_len=96).max_model_len == 96


def test_cluster_stops_at_an_eos_id_only_generation_config_lists(tiny_copy, tmp_path):
    prompt = make_prompts((20,), seed=41)[0]
    free_run, _ = hf_greedy(tiny_copy, torch.float32, tuple(prompt))
    step = next(s for s in range(3, 16) if free_run[s] not in free_run[:s] + [CONFIG_EOS])
    extra_eos = free_run[step]
    write_generation_config(tiny_copy, eos_token_id=[CONFIG_EOS, extra_eos])
    assert json.loads((tiny_copy / "config.json").read_text())["eos_token_id"] == CONFIG_EOS
    args = up_args(tiny_copy, max_model_len=64, generation_config="auto")
    cluster = start_cluster(args, tmp_path)
    try:
        with Client(cluster.router_address) as client:
            info = client.model_info()
            assert list(info.eos_token_ids) == [CONFIG_EOS, extra_eos]
            assert info.max_model_len == 64
            greedy = SamplingParams(temperature=0.0, max_tokens=24)
            parts = list(client.generate(prompt, greedy, timeout=60))
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(prompt, SamplingParams(max_tokens=45), timeout=60))
    finally:
        cluster.stop()
    tokens = [t for p in parts for t in p.token_ids]
    assert tokens == free_run[: step + 1]
    assert parts[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in (err.value.details() or "")
