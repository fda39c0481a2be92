"""The command lines are the CLI's: every container's arguments (and the download job's) parse
with the real parsers, and values reach the flags of the roles they are meant for."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chart import (
    HF_REPO,
    LINUX_AMD64_ONLY,
    MATRIX,
    OTLP,
    PENDING_FLAGS,
    ROLES,
    TLS_FLAG_KEYS,
    Doc,
    Tools,
    _set,
    chart_containers,
    container,
    deployment,
    expand,
    flag,
    render,
    role_parser,
    without_pending_flags,
)

from pagedserve.cli import build_parser

pytestmark = LINUX_AMD64_ONLY


@pytest.mark.parametrize("case", list(MATRIX))
def test_every_command_line_parses_with_the_cli(renders: dict[str, list[Doc]], case: str) -> None:
    """Every pagedserve command line the chart renders, init containers included, parses with
    `pagedserve`'s own parser with nothing left over: the chart passes only flags that exist."""
    parsed = 0
    for name, _, box in chart_containers(renders[case]):
        if box.get("command") == ["hf"]:
            continue  # the Hub CLI: test_hf_download_args_parse_with_the_hub_cli
        assert "command" not in box, name  # the image's entrypoint: pagedserve
        argv = expand(box["args"])
        args, rest = build_parser().parse_known_args(argv)
        assert rest == [], (name, rest)
        assert vars(build_parser().parse_args(argv)) == vars(args)
        for option in (*TLS_FLAG_KEYS, "--tls-server-name", "--api-key-file"):
            if option in argv:
                assert getattr(args, option.lstrip("-").replace("-", "_")) == flag(argv, option)
        parsed += 1
    assert parsed >= 3


def test_hf_download_args_parse_with_the_hub_cli(
    renders: dict[str, list[Doc]], tmp_path: Path
) -> None:
    """The init container's `hf download` command line, run offline: the Hub CLI accepts every
    flag (a usage error exits 2) and gets as far as the download."""
    hf = Path(sys.executable).parent / "hf"  # NOTE: huggingface_hub's CLI, via transformers
    assert hf.exists(), "huggingface_hub's hf CLI should come with transformers"
    (init,) = deployment(renders["production"], "decode")["spec"]["template"]["spec"][
        "initContainers"
    ]
    assert init["command"] == ["hf"]
    args = list(init["args"])
    assert args[:2] == ["download", HF_REPO]
    args[args.index("--local-dir") + 1] = str(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([str(hf), *args], capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # 2: the CLI refused a flag
    assert "offline mode" in output, output


@pytest.mark.parametrize("case", list(MATRIX))
def test_container_args_parse_with_the_cli(renders: dict[str, list[Doc]], case: str) -> None:
    for role, (_, port) in ROLES.items():
        box = container(renders[case], role)
        argv = expand(without_pending_flags(role, box["args"]))
        args = build_parser().parse_args(argv)
        assert args.command == role
        assert args.func.__name__ == f"_run_{role}"  # the same service `pagedserve <role>` runs
        assert args.port == port
        assert args.model == "/model"
        assert args.redis_url.startswith("redis://")
        if role != "router":
            assert args.advertise_address == f"10.1.2.3:{port}"
        for pending in PENDING_FLAGS:
            if pending in argv:
                assert getattr(args, pending.lstrip("-").replace("-", "_")) is not None


def test_pending_flags_are_dropped_only_when_the_cli_lacks_them() -> None:
    for role in ROLES:
        known = role_parser(role)._option_string_actions
        args = without_pending_flags(role, ["--port", "1", *PENDING_FLAGS[:1], OTLP])
        assert (PENDING_FLAGS[0] in args) == (PENDING_FLAGS[0] in known)
        assert args[:2] == ["--port", "1"]


def test_router_values_reach_its_flags(renders: dict[str, list[Doc]], tools: Tools) -> None:
    """Every router value is a flag of its command line: the defaults are the CLI's, a value
    set in the chart reaches the process."""
    cli = build_parser().parse_args(["router", "--model", "/model"])
    names = ("max_queued_requests", "load_poll_interval", "max_local_prefill_tokens",
             "local_prefill_queue_tokens")  # fmt: skip
    box = container(renders["defaults"], "router")
    args = build_parser().parse_args(expand(without_pending_flags("router", box["args"])))
    assert {n: getattr(args, n) for n in names} == {n: getattr(cli, n) for n in names}
    docs = render(
        tools.helm4,
        _set("router.maxLocalPrefillTokens=0", "router.localPrefillQueueTokens=64",
             "router.maxQueuedRequests=9", "router.loadPollInterval=2"),
    )  # fmt: skip
    box = container(docs, "router")
    args = build_parser().parse_args(expand(without_pending_flags("router", box["args"])))
    assert {n: getattr(args, n) for n in names} == dict(zip(names, (9, 2.0, 0, 64), strict=True))


def test_quantization_reaches_every_role(renders: dict[str, list[Doc]], tools: Tools) -> None:
    """`model.quantization` is part of every block hash: the router and both workers get the
    same flags, parsed by the real CLI; unset, none of them is quantized."""
    roles = ("router", "prefill", "decode")

    def parsed(docs: list[Doc], role: str) -> argparse.Namespace:
        box = container(docs, role)
        return build_parser().parse_args(expand(without_pending_flags(role, box["args"])))

    for role in roles:
        assert parsed(renders["defaults"], role).quantization is None
    docs = render(tools.helm4, _set("model.quantization=int4", "model.quantizationGroupSize=64"))
    for role in roles:
        args = parsed(docs, role)
        assert (args.quantization, args.quantization_group_size) == ("int4", 64), role
        assert not args.quantize_lm_head
    docs = render(tools.helm4, _set("model.quantization=int8", "model.quantizeLmHead=true"))
    for role in roles:
        args = parsed(docs, role)
        assert (args.quantization, args.quantize_lm_head) == ("int8", True), role


def test_kv_cache_dtype_reaches_both_workers_not_the_router(
    renders: dict[str, list[Doc]], tools: Tools
) -> None:
    """`model.kvCacheDtype` sets both workers' KV pages (they must agree to hand blocks off);
    the router has no KV cache and no such flag."""
    for role in ("prefill", "decode"):
        args = expand(without_pending_flags(role, container(renders["defaults"], role)["args"]))
        assert build_parser().parse_args(args).kv_cache_dtype == "auto"
    docs = render(tools.helm4, _set("model.kvCacheDtype=int8"))
    for role in ("prefill", "decode"):
        args = expand(without_pending_flags(role, container(docs, role)["args"]))
        assert build_parser().parse_args(args).kv_cache_dtype == "int8", role
    assert "--kv-cache-dtype" not in container(docs, "router")["args"]
