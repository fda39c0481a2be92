"""`--tensor-parallel-size` / `-tp` (pagedserve/cli_options.py): both workers,
`generate --model` and `up` take it; `up` passes it to every prefill and decode worker and never
to the router; `up --device` reaches the workers the same way."""

from __future__ import annotations

import pytest

from pagedserve import launcher
from pagedserve.cli import build_parser

MODEL_RUNNERS = (["prefill"], ["decode"], ["up"], ["generate", "hello"])


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", MODEL_RUNNERS, ids=lambda c: c[0])
def test_every_model_runner_takes_the_flag_and_its_alias(command: list[str]) -> None:
    assert parse(*command, "--model", "m").tensor_parallel_size == 1
    assert parse(*command, "--model", "m", "--tensor-parallel-size", "2").tensor_parallel_size == 2
    assert parse(*command, "--model", "m", "-tp", "4").tensor_parallel_size == 4


@pytest.mark.parametrize("command", MODEL_RUNNERS, ids=lambda c: c[0])
@pytest.mark.parametrize("size", ["0", "-2"])
def test_a_size_below_one_is_refused_naming_the_flag(
    command: list[str], size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*command, "--model", "m", "-tp", size)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --tensor-parallel-size/-tp: must be >= 1, got {size}" in err


def test_the_router_has_no_such_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("router", "--model", "m", "--tensor-parallel-size", "2")
    assert "unrecognized arguments: --tensor-parallel-size 2" in capsys.readouterr().err


def test_up_passes_the_size_to_both_worker_kinds_and_not_the_router() -> None:
    given = parse("up", "--model", "m", "-tp", "2")
    for role in ("prefill", "decode"):
        flags = launcher._worker_flags(role, given)
        assert flags.count("--tensor-parallel-size") == 1, role
        assert flags[flags.index("--tensor-parallel-size") + 1] == "2", role
        argv = [role, "--model", "m", *flags]
        assert parse(*argv).tensor_parallel_size == 2, "the worker's own parser reads it back"
    router = [*launcher._common_flags(given), *launcher._router_flags(given, [])]
    assert "--tensor-parallel-size" not in router
    assert "-tp" not in router


def test_up_passes_nothing_for_the_default_size() -> None:
    for argv in (["up", "--model", "m"], ["up", "--model", "m", "-tp", "1"]):
        args = parse(*argv)
        for role in ("prefill", "decode"):
            assert "--tensor-parallel-size" not in launcher._worker_flags(role, args)


def test_up_passes_its_device_to_both_worker_kinds_and_not_the_router() -> None:
    given = parse("up", "--model", "m", "--device", "cuda")
    for role in ("prefill", "decode"):
        argv = [role, "--model", "m", *launcher._worker_flags(role, given)]
        assert parse(*argv).device == "cuda", role
    assert "--device" not in [*launcher._common_flags(given), *launcher._router_flags(given, [])]
    default = parse("up", "--model", "m")
    assert all("--device" not in launcher._worker_flags(r, default) for r in ("prefill", "decode"))
