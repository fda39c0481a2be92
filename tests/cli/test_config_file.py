"""`--config FILE` (pagedserve/config_file.py): a command's flags from YAML, the command line
winning, and an unknown key or a bad value refused with the key named (exit status 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.cli import build_parser
from pagedserve.config_file import parse_args

UP_FILE = """\
model: /models/tiny
served-model-name: chat
port: 6000
prefill: 2
kv_cache_memory: 32MiB
metrics: true
decode-delivery: false
swap-space: 1.5
log-format: json
"""


def parse(*argv: str):
    return parse_args(build_parser(), list(argv))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "flags.yaml"
    path.write_text(text)
    return str(path)


def test_up_takes_the_files_flags_and_the_command_line_wins(tmp_path):
    args = parse("up", "--config", write(tmp_path, UP_FILE), "--port", "7001")
    assert args.port == 7001  # the command line's
    assert (args.model, args.served_model_name, args.prefill) == ("/models/tiny", "chat", 2)
    assert (args.kv_cache_memory, args.swap_space, args.log_format) == ("32MiB", 1.5, "json")
    assert args.metrics is True and args.decode_delivery is False
    assert (args.decode, args.log_level) == (1, "info")  # not in the file: the defaults
    assert parse("up", "--config", write(tmp_path, UP_FILE), "--decode-delivery").decode_delivery


def test_a_repeatable_flag_is_a_list_in_the_file_and_the_command_line_replaces_it(tmp_path):
    path = write(tmp_path, "model: m\nprefill: [a:1, b:2]\ndecode: c:3\nno-decode-delivery: true\n")
    args = parse("router", "--config", path)
    assert (args.prefill, args.decode, args.decode_delivery) == (["a:1", "b:2"], ["c:3"], False)
    args = parse("router", f"--config={path}", "--prefill", "z:9")
    assert (args.prefill, args.decode) == (["z:9"], ["c:3"])


def test_every_service_command_takes_a_config_file(tmp_path):
    path = write(tmp_path, "log_level: warning\nmax_message_bytes: 1MiB\n")
    for command in (["router", "--model", "m"], ["prefill", "--model", "m"],
                    ["decode", "--model", "m"], ["gateway", "--router", "r:1"]):  # fmt: skip
        args = parse(*command, "--config", path)
        assert (args.log_level, args.max_message_bytes) == ("warning", 1 << 20), command


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("model: m\nno-such-flag: 1\n", "no-such-flag: unknown key"),
        ("model: m\nport: abc\n", "port: invalid int value: 'abc'"),
        ("model: m\ndtype: float8\n", "dtype: invalid choice: 'float8'"),
        ("model: m\nmetrics: 1\n", "metrics: expected true or false"),
        ("model: m\nport: [1, 2]\n", "port: expected one value"),
        ("- model\n", "the file must be a mapping"),
    ],
)
def test_an_unknown_key_or_a_bad_value_is_an_argparse_error_naming_it(
    tmp_path, capsys, text, named
):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_:
        parse("up", "--config", path)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"pagedserve up: error: --config {path}: {named}" in err, err


def test_a_required_flag_may_come_from_the_file_only(tmp_path):
    assert parse("up", "--config", write(tmp_path, "model: /m\n")).model == "/m"
    with pytest.raises(SystemExit):
        parse("up", "--config", write(tmp_path, "port: 1\n"))  # --model still required
