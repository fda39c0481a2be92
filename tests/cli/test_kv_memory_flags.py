"""`pagedserve up --kv-cache-memory` and `--prefill-kv-cache-memory`: each worker's KV budget."""

from __future__ import annotations

from pagedserve import launcher
from pagedserve.cli import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["up", "--model", "m", *argv])


def flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_prefill_workers_take_their_own_budget_when_given():
    args = parse("--kv-cache-memory", "448MiB", "--prefill-kv-cache-memory", "64MiB")
    assert flag(launcher._worker_flags("prefill", args), "--kv-cache-memory") == "64MiB"
    assert flag(launcher._worker_flags("decode", args), "--kv-cache-memory") == "448MiB"
    assert launcher.memory_plan("prefill", args).startswith("KV cache 64.0 MiB")
    assert launcher.memory_plan("decode", args).startswith("KV cache 448.0 MiB")


def test_without_it_every_worker_gets_the_common_budget():
    args = parse("--kv-cache-memory", "96MiB")
    for role in ("prefill", "decode"):
        assert flag(launcher._worker_flags(role, args), "--kv-cache-memory") == "96MiB"


def test_a_bad_size_is_refused_naming_its_flag(capsys):
    for argv, named in [
        (("--prefill-kv-cache-memory", "lots"), "prefill-kv-cache-memory"),
        (("--prefill-kv-cache-memory", "0"), "prefill-kv-cache-memory"),
        (("--kv-cache-memory", "12 parsecs"), "kv-cache-memory"),
    ]:
        assert launcher.main(parse(*argv)) == 2
        assert f"error: {named}:" in capsys.readouterr().err
