"""Speculative decoding's flags (decode_worker/cli_args.py): the decode worker and `up` take
them; `up` passes them to decode workers only; bad values are refused naming the flag."""

from __future__ import annotations

import pytest

from pagedserve import launcher
from pagedserve.cli import build_parser
from pagedserve.decode_worker.engine import DecodeEngineConfig
from pagedserve.decode_worker.server import speculative_config
from pagedserve.decode_worker.speculation import SpeculativeConfig, SpeculativeMethod


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_up_passes_the_flags_to_decode_workers_only_and_they_read_them_back() -> None:
    given = parse("up", "--model", "m", "--speculative-method", "ngram",
                  "--num-speculative-tokens", "6", "--speculative-ngram-max", "3")  # fmt: skip
    flags = launcher._worker_flags("decode", given)
    config = speculative_config(parse("decode", "--model", "m", *flags))
    assert config == SpeculativeConfig(SpeculativeMethod.NGRAM, num_tokens=6, ngram_max=3)
    assert not any("speculative" in f for f in launcher._worker_flags("prefill", given))
    router = [*launcher._common_flags(given), *launcher._router_flags(given, [])]
    assert not any("speculative" in f for f in router)


def test_up_passes_a_draft_model_and_a_lone_model_flag_is_refused() -> None:
    given = parse("up", "--model", "m", "--speculative-method", "draft",
                  "--speculative-model", "small")  # fmt: skip
    flags = launcher._worker_flags("decode", given)
    config = speculative_config(parse("decode", "--model", "m", *flags))
    assert config == SpeculativeConfig(SpeculativeMethod.DRAFT, draft_model="small")
    with pytest.raises(ValueError, match="speculative-model: goes with --speculative-method"):
        speculative_config(parse("decode", "--model", "m", "--speculative-model", "small"))


def test_off_by_default_and_nothing_passed() -> None:
    assert speculative_config(parse("decode", "--model", "m")) is None
    flags = launcher._worker_flags("decode", parse("up", "--model", "m"))
    assert not any("speculative" in f for f in flags)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-speculative-tokens", "0"], "num-speculative-tokens: must be in [1, 16], got 0"),
        (["--speculative-ngram-min", "3", "--speculative-ngram-max", "2"],
         "speculative-ngram-min: must be in [1, speculative-ngram-max = 2], got 3"),
        (["--speculative-max-batch", "0"], "speculative-max-batch: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_flag(argv: list[str], message: str) -> None:
    args = parse("decode", "--model", "m", "--speculative-method", "ngram", *argv)
    with pytest.raises(ValueError) as exc:
        speculative_config(args)
    assert str(exc.value) == message


def test_an_unknown_method_and_tensor_parallelism_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse("decode", "--model", "m", "--speculative-method", "eagle")
    assert "--speculative-method: invalid choice: 'eagle'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="speculative-method: .* --tensor-parallel-size"):
        DecodeEngineConfig(tensor_parallel_size=2, speculative=SpeculativeConfig())
