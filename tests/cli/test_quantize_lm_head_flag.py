"""`--quantize-lm-head` (pagedserve/cli_options.py): every command that runs or fronts a model
takes it; `up` passes it to the router and every worker with `--quantization`; without a
quantization method it is refused, naming the flag, never silently ignored."""

from __future__ import annotations

import pytest

from pagedserve import launcher
from pagedserve.cli import build_parser
from pagedserve.router.server import RouterOptions

COMMANDS = (["prefill"], ["decode"], ["up"], ["router"], ["generate", "hello"])


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_command_takes_the_flag_off_by_default(command: list[str]) -> None:
    assert not parse(*command, "--model", "m").quantize_lm_head
    assert parse(*command, "--model", "m", "--quantization", "int8",
                 "--quantize-lm-head").quantize_lm_head  # fmt: skip


def test_up_passes_it_to_every_role_with_the_quantization() -> None:
    args = parse("up", "--model", "m", "--quantization", "int8", "--quantize-lm-head")
    common = launcher._common_flags(args)
    for role in ("router", "prefill", "decode"):
        routed = parse(role, *common)
        assert (routed.quantization, routed.quantize_lm_head) == ("int8", True), role


def test_without_a_quantization_it_is_refused_by_up_and_the_router(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert launcher.main(parse("up", "--model", "m", "--quantize-lm-head")) == 2
    assert "quantize_lm_head: needs --quantization" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantize_lm_head"):
        RouterOptions.from_args(parse("router", "--model", "m", "--quantize-lm-head"))
