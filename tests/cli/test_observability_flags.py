"""`--metrics-names` and `--otlp-traces-protocol` (pagedserve/cli_options.py): every service
takes them, and `pagedserve up` passes what it was given to the router, every worker and the
gateway, whose own parsers read them back."""

from __future__ import annotations

import argparse

import pytest

from pagedserve import launcher
from pagedserve.cli import build_parser

FLAGS = ["--metrics-names", "vllm", "--otlp-traces-protocol", "http/protobuf",
         "--otlp-traces-endpoint", "http://collector:4318"]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_up_passes_them_to_the_router_and_every_worker(role: str) -> None:
    args = parse("up", "--model", "m", *FLAGS)
    given = parse(role, *launcher._common_flags(args))
    assert given.metrics_names == "vllm"
    assert given.otlp_traces_protocol == "http/protobuf"
    assert given.otlp_traces_endpoint == "http://collector:4318"


def test_the_gateway_takes_them_and_up_leaves_the_defaults_unsaid() -> None:
    gateway = parse("gateway", "--router", "r:1", *FLAGS)
    assert (gateway.metrics_names, gateway.otlp_traces_protocol) == ("vllm", "http/protobuf")
    plain = parse("up", "--model", "m")
    assert plain.metrics_names == "pagedserve" and plain.otlp_traces_protocol is None
    common = launcher._common_flags(plain)
    assert "--metrics-names" not in common and "--otlp-traces-protocol" not in common


def test_an_unknown_naming_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("router", "--model", "m", "--metrics-names", "tgi")
    assert "--metrics-names" in capsys.readouterr().err
