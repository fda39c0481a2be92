"""The Dockerfile the chart's image is built from: a non-root user, the Makefile's torch, nothing
piped into a shell, and a .dockerignore that keeps the venv and .git out."""

from __future__ import annotations

import re

from chart import LINUX_AMD64_ONLY, ROOT

pytestmark = LINUX_AMD64_ONLY


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_runs_pagedserve_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    users = [value for op, value in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [v for op, v in instructions if op == "ENTRYPOINT"][-1] == '["pagedserve"]'
    env = " ".join(v for op, v in instructions if op == "ENV")
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/tmp/" in env


def test_dockerfile_pins_the_makefiles_torch_and_pipes_nothing_into_a_shell() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"(curl|wget)[^\n|]*\|\s*(ba)?sh", text)
    (version,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", text, flags=re.MULTILINE)
    assert '"torch==${TORCH_VERSION}"' in text
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= torch=={version}" in makefile
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, flags=re.MULTILINE)


def test_dockerignore_keeps_the_venv_and_git_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache"} <= set(ignored)
