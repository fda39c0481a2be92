"""The Dockerfile the chart's images are built from: a non-root user, the Makefile's torch,
nothing piped into a shell, a .dockerignore that keeps the venv and .git out, and the images each
role runs (router and gateway the torch-free `slim` target, workers the full one)."""

from __future__ import annotations

import re

import yaml
from chart import (
    CHART,
    LINUX_AMD64_ONLY,
    ROOT,
    Doc,
    Tools,
    _set,
    chart_containers,
    render,
)

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


def images(docs: list[Doc]) -> dict[str, str]:
    """container name -> image, over the chart's Deployments (init containers included)."""
    return {box["name"]: box["image"] for _, _, box in chart_containers(docs)}


def test_router_and_gateway_run_the_slim_image_workers_the_full_one(
    tools: Tools, renders: dict[str, list[Doc]]
) -> None:
    """Router and gateway default to the Dockerfile's torch-free `slim` target (tag
    <appVersion>-slim, the repository of `image`); prefill and decode keep the full image, the
    GPU preset's CUDA tag included; a router's `hf download` init container runs the slim image,
    a `fetch-model` conversion (torch) the full one."""
    assert ("FROM", "${SLIM_BASE_IMAGE} AS slim") in dockerfile_instructions()
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    repo = "ghcr.io/pagedserve/pagedserve"
    got = images(renders["defaults"])
    assert (got["router"], got["gateway"]) == (f"{repo}:{version}-slim",) * 2
    assert (got["prefill"], got["decode"]) == (f"{repo}:{version}",) * 2
    production = {
        (name.rsplit("-", 1)[1], box["name"]): box["image"]
        for name, _, box in chart_containers(renders["production"])
    }
    assert production[("router", "router")] == f"{repo}:{version}-slim"
    assert production[("router", "model-download")] == f"{repo}:{version}-slim"  # hf download
    assert production[("decode", "decode")] == f"{repo}:{version}-cu128"
    fetch = {
        (name.rsplit("-", 1)[1], box["name"]): box["image"]
        for name, _, box in chart_containers(renders["tls-secret-fetch-model"])
    }
    assert fetch[("router", "model-download")] == f"{repo}:{version}"  # fetch-model needs torch
    # one registry for all: the slim image follows image.repository; a role's own wins
    docs = render(tools.helm4, _set(
        "image.repository=registry.example/ps", "gateway.image.tag=custom",
        "router.image.digest=sha256:" + "a" * 64,
    ))  # fmt: skip
    got = images(docs)
    assert got["router"] == "registry.example/ps@sha256:" + "a" * 64
    assert got["gateway"] == "registry.example/ps:custom"
    assert got["decode"] == f"registry.example/ps:{version}"
