"""Sampling parameters survive the wire exactly, and unset fields mean the defaults."""

from __future__ import annotations

from pagedserve.protoconv import sampling_from_proto, sampling_to_proto
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2


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
    )
    wire = sampling_to_proto(params).SerializeToString()
    assert sampling_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


def test_unset_fields_take_defaults_and_explicit_zero_is_kept():
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    greedy = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, max_tokens=5))
    assert greedy.temperature == 0.0 and greedy.greedy and greedy.max_tokens == 5
    assert sampling_to_proto(SamplingParams()).HasField("temperature")
    assert not sampling_to_proto(SamplingParams()).HasField("logprobs")
