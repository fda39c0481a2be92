"""The image builds what pyproject.toml installs: every folder of `[tool.setuptools.package-dir]`
is copied into each build stage of the Dockerfile (a missing one fails `pip install .` only at
image build time, which no other test runs). The `slim` target (the Helm chart's router and
gateway image) installs pagedserve without torch: `--no-deps` over requirements-slim.txt, whose
lines are pyproject's own dependencies and cover every distribution the router and the gateway
load. Docker is not run here: the Dockerfile is parsed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# what neither the router nor the gateway imports (import-linter contracts), and the slim image
# must not carry
HEAVY = {"torch", "triton", "transformers", "xgrammar", "safetensors", "numpy"}


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions (op, value), by stage name ("" for an unnamed one)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, value = line.partition(" ")
        if op.upper() == "FROM":
            name = value.split(" AS ")[1].strip() if " AS " in value else ""
            current = out.setdefault(name, [])
        if current is not None:
            current.append((op.upper(), value.strip()))
    return out


def package_folders() -> set[str]:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    return {folder.split("/")[0] for folder in mapping.values()}


def test_every_package_folder_is_copied_into_each_build_stage():
    for name in ("build", "slim-build"):
        copied = {
            m.group(1)
            for op, value in stages()[name]
            if op == "COPY" and (m := re.fullmatch(r"(\S+) \./\1", value))
        }
        missing = package_folders() - copied
        assert not missing, f"not copied into stage {name}: {sorted(missing)}"


def test_slim_target_installs_pagedserve_without_torch_and_runs_it_unprivileged():
    all_stages = stages()
    assert list(all_stages)[-1] == "full"  # the default target stays the full image
    build = " ".join(v for op, v in all_stages["slim-build"] if op == "RUN")
    assert "pip install -r requirements-slim.txt" in build
    assert "pip install --no-deps ." in build
    assert "torch==" not in build and "TORCH_INDEX_URL" not in build
    # the build fails if either role's import path reaches torch
    assert "pagedserve.router.server" in build and "pagedserve.gateway.server" in build
    slim = all_stages["slim"]
    assert slim[0] == ("FROM", "${SLIM_BASE_IMAGE} AS slim")
    assert ("COPY", "--from=slim-build /opt/pagedserve /opt/pagedserve") in slim
    user = [v for op, v in slim if op == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert [v for op, v in slim if op == "ENTRYPOINT"] == ['["pagedserve"]']
    env = " ".join(v for op, v in slim if op == "ENV")
    assert "HOME=/tmp" in env and "HF_HUB_OFFLINE=1" in env
    assert re.search(r"^ARG SLIM_BASE_IMAGE=python:3\.11-slim$",
                     (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)  # fmt: skip


def slim_requirements() -> list[Requirement]:
    lines = (ROOT / "requirements-slim.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_slim_requirements_are_pyprojects_own_without_the_heavy_ones():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {canonicalize_name(Requirement(d).name): str(Requirement(d)) for d in declared}
    for requirement in slim_requirements():
        assert by_name.get(canonicalize_name(requirement.name)) == str(requirement), requirement
        assert canonicalize_name(requirement.name) not in HEAVY
    assert (ROOT / ".dockerignore").read_text().count("requirements") == 0  # in the context


def closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions these requirements pull (markers as pip evaluates them)."""
    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for extra in requirement.extras:  # e.g. a `pkg[extra]` line
            todo += [
                r for r in map(Requirement, metadata.requires(name) or [])
                if r.marker is not None and r.marker.evaluate({"extra": extra})
            ]  # fmt: skip
        todo += [
            r for r in map(Requirement, metadata.requires(name) or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]  # fmt: skip
    return seen


# Import the roles with every distribution outside the slim image hidden, as in that image.
HIDDEN_IMPORT = """
import importlib.abc, json, sys
hidden = set(json.loads(sys.argv[1]))


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"not in the slim image: {name}", name=name)
        return None


sys.meta_path.insert(0, Hide())
import pagedserve.cli, pagedserve.router.server, pagedserve.gateway.server, pagedserve.client
import pagedserve.fetch_model  # `pagedserve ROLE --model DIR` resolves DIR with it
pagedserve.cli.build_parser()
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_router_and_gateway_import_with_only_the_slim_requirements():
    """The router's, the gateway's and the CLI client's import paths, with every installed
    distribution that requirements-slim.txt does not pull hidden (torch included), import and
    build the CLI parser; nothing heavy is loaded."""
    allowed = closure(slim_requirements()) | {"pagedserve", "pagedserve-client"}  # both --no-deps
    owners = metadata.packages_distributions()
    hidden = {
        top for top, dists in owners.items()
        if not {canonicalize_name(d) for d in dists} & allowed
    }  # fmt: skip
    assert {"torch", "transformers"} <= hidden  # installed here, hidden there
    result = subprocess.run([sys.executable, "-c", HIDDEN_IMPORT, json.dumps(sorted(hidden))],
                            capture_output=True, text=True, timeout=120, cwd="/")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert not set(json.loads(result.stdout)) & HEAVY


def test_the_image_installs_the_client_distribution_before_pagedserve():
    # NOTE: pagedserve depends on pagedserve-client, which no package index has
    for name, install in (("build", "pip install ."), ("slim-build", "pip install --no-deps .")):
        steps = [f"{op} {value}" for op, value in stages()[name]]
        assert "COPY clients/python ./clients/python" in steps, name
        client = next(
            i for i, s in enumerate(steps) if "pip install" in s and "clients/python" in s
        )
        pagedserve = next(i for i, s in enumerate(steps) if install in s and "clients" not in s)
        assert client < pagedserve, name
