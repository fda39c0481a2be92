"""`--config FILE`: a command's flags from a YAML file, for every command that offers it.

The file is a mapping whose keys are the command's long flag names, with `-` or `_`
(`kv-cache-memory`, `kv_cache_memory`, `tensor_parallel_size`), and whose values are what the
flag takes: a scalar for a flag with one value (converted and checked as argparse converts and
checks the command line: `type`, `choices`), a list (or one scalar) for a repeatable flag,
true / false for a switch (`metrics: true`; `decode-delivery: false` or `no-decode-delivery:
true`). Every flag of the command is allowed, its required ones too. The command line wins: a
flag given there replaces the file's value, a repeatable one included. An unknown key or a bad
value is an error naming the file and the key (exit status 2, as argparse's own errors).

How: the file's values become the parser's defaults (a required flag the file gives is no
longer required), then the command line is parsed as usual (`parse_args`, below).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)
_LISTS = (argparse._AppendAction, argparse._ExtendAction)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, metavar="FILE",
        help="YAML file of this command's flags (keys: long flag names, with - or _); the "
        "command line wins over it",
    )  # fmt: skip


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_known_args(argv)`, after applying the `--config FILE` of `argv`'s
    subcommand when it has one (its values as defaults); the unknown arguments are kept in
    the namespace's `rest`."""
    command = _subcommand(parser, argv)
    path = _config_path(argv)
    file_lists: dict[str, list[Any]] = {}
    if command is not None and path is not None and _offers_config(command):
        file_lists = apply_config_file(command, path)
    args, rest = parser.parse_known_args(argv)
    for dest, items in file_lists.items():
        given = getattr(args, dest)
        if len(given) > len(items):  # NOTE: argparse appended the command line's to the file's
            setattr(args, dest, given[len(items) :])
    args.rest = rest
    return args


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, list[Any]]:
    """Set `parser`'s defaults from the YAML file at `path`; `parser.error` (exit 2) names the
    key of a bad entry. Returns the repeatable flags' lists the file set (dest -> items)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {' '.join(str(exc).split())}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: the file must be a mapping of flag names to values")
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        try:
            action, option = _action_of(parser, str(key))
            defaults[action.dest] = _convert(parser, action, option, value)
        except argparse.ArgumentError as exc:
            parser.error(f"--config {path}: {key}: {exc.message}")
        action.required = False  # NOTE: given by the file
    parser.set_defaults(**defaults)
    return {
        a.dest: defaults[a.dest]
        for a in parser._actions
        if isinstance(a, _LISTS) and a.dest in defaults
    }


def _action_of(parser: argparse.ArgumentParser, key: str) -> tuple[argparse.Action, str]:
    """The action and option string `key` names (`tensor_parallel_size`, `--no-metrics`...)."""
    option = "--" + key.removeprefix("--").replace("_", "-")
    for action in parser._actions:
        if option in action.option_strings and option not in ("--config", "--help"):
            return action, option
    raise argparse.ArgumentError(None, f"unknown key ({parser.prog} has no {option})")


def _convert(
    parser: argparse.ArgumentParser, action: argparse.Action, option: str, value: Any
) -> Any:
    """`value` as the command line's `option` would have set `action.dest`."""
    if isinstance(action, (argparse.BooleanOptionalAction, *_SWITCHES)):
        if not isinstance(value, bool):
            raise argparse.ArgumentError(None, f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value != option.startswith("--no-")
        if isinstance(action, argparse._StoreFalseAction):
            return not value
        return action.const if value else action.default
    if isinstance(action, argparse._CountAction):
        if isinstance(value, bool) or not isinstance(value, int):
            raise argparse.ArgumentError(None, f"expected a count, got {value!r}")
        return value
    if not isinstance(action, (argparse._StoreAction, *_LISTS)):
        raise argparse.ArgumentError(None, f"{option} cannot be set from a file")
    many = isinstance(action, _LISTS) or action.nargs in ("+", "*") or isinstance(action.nargs, int)
    items = value if isinstance(value, list) else [value]
    if not many and isinstance(value, list):
        raise argparse.ArgumentError(None, f"expected one value, got a list {value!r}")
    converted = [_convert_one(parser, action, item) for item in items]
    return converted if many else converted[0]


def _convert_one(parser: argparse.ArgumentParser, action: argparse.Action, item: Any) -> Any:
    if isinstance(item, dict | list | bool) or item is None:
        raise argparse.ArgumentError(None, f"expected a value, got {item!r}")
    # NOTE: argparse's own conversion and check (the command line's errors, word for word)
    value = parser._get_value(action, str(item))
    parser._check_value(action, value)
    return value


def _config_path(argv: Sequence[str]) -> str | None:
    """The value of `--config` in `argv` (`--config F` or `--config=F`), else None."""
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def _subcommand(parser: argparse.ArgumentParser, argv: Sequence[str]):
    """The subparser `argv` names (its first word), or None."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words = [t for t in argv if not t.startswith("-")]
            return action.choices.get(words[0]) if words else None
    return None


def _offers_config(parser: argparse.ArgumentParser) -> bool:
    return any("--config" in a.option_strings for a in parser._actions)
