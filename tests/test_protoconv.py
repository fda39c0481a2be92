"""Sampling parameters and loads survive the wire exactly; unset fields mean the defaults."""

from __future__ import annotations

import pytest

from pagedserve.errors import InvalidArgument
from pagedserve.protoconv import (
    load_from_proto,
    load_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from pagedserve.sampling_params import SamplingParams, StructuredOutput
from pagedserve.v1 import common_pb2
from pagedserve.worker_load import Role, WorkerLoad


def test_round_trip_keeps_every_field_exactly():
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=2**40 + 3,
        max_tokens=64,
        min_tokens=2,
        stop=("\n\n", "END"),
        stop_token_ids=(5, 9),
        ignore_eos=True,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logprobs=3,
        skip_special_tokens=False,
        prompt_logprobs=0,
    )
    wire = sampling_to_proto(params).SerializeToString()
    assert sampling_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


def test_grammars_and_logits_controls_survive_the_wire():
    grammars = [
        StructuredOutput("json_schema", '{"type": "object"}'),
        StructuredOutput("json", resumed_tokens=3),
        StructuredOutput("regex", "[a-z]+"),
        StructuredOutput("choice", choices=("yes", "no")),
        StructuredOutput("grammar", 'root ::= "a"'),
    ]
    for grammar in grammars:
        params = SamplingParams(structured_output=grammar, logit_bias=((3, -100.0), (7, 0.5)),
                                allowed_token_ids=(1, 2), bad_words=("no", "never"),
                                bad_word_ids=((4,), (5, 6)))  # fmt: skip
        wire = sampling_to_proto(params).SerializeToString()
        assert sampling_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


def test_a_structured_output_without_a_kind_is_refused_by_name():
    msg = common_pb2.SamplingParams()
    msg.structured_output.resumed_tokens = 0
    msg.structured_output.SetInParent()
    with pytest.raises(InvalidArgument) as info:
        sampling_from_proto(msg)
    assert info.value.field == "structured_output"


def test_unset_fields_take_defaults_and_explicit_zero_is_kept():
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    greedy = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, max_tokens=5))
    assert greedy.temperature == 0.0 and greedy.greedy and greedy.max_tokens == 5
    assert sampling_to_proto(SamplingParams()).HasField("temperature")
    assert not sampling_to_proto(SamplingParams()).HasField("logprobs")
    assert not sampling_to_proto(SamplingParams()).HasField("prompt_logprobs")


def test_load_report_round_trip_keeps_every_load_field():
    load = WorkerLoad(
        num_requests_running=3,
        num_requests_waiting=5,
        num_requests_swapped=1,
        queued_prefill_tokens=700,
        kv_blocks_total=64,
        kv_blocks_free=40,
        kv_blocks_cached=8,
        kv_cache_usage=0.25,
        prefix_cache_hit_rate=0.5,
        draining=True,
        reported_at_unix_ms=1_700_000_000_123,
    )
    msg = load_to_proto(load, "decode-1", Role.DECODE)
    assert (msg.worker_id, msg.role) == ("decode-1", common_pb2.WORKER_ROLE_DECODE)
    wire = common_pb2.LoadReport.FromString(msg.SerializeToString())
    assert load_from_proto(wire) == load
    assert load_to_proto(load_from_proto(wire), "decode-1", Role.DECODE) == wire


def test_load_report_names_the_role_of_each_worker_kind():
    roles = {role: load_to_proto(WorkerLoad(), "w", role).role for role in Role}
    assert roles == {
        Role.ROUTER: common_pb2.WORKER_ROLE_ROUTER,
        Role.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
        Role.DECODE: common_pb2.WORKER_ROLE_DECODE,
    }
