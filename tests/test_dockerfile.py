"""The image builds what pyproject.toml installs: every folder of `[tool.setuptools.package-dir]`
is copied into the Dockerfile's build stage (a missing one fails `pip install .` only at image
build time, which no other test runs)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_copied_into_the_image():
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    tops = {folder.split("/")[0] for folder in mapping.values()}
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert tops <= copied, f"not copied into the image: {sorted(tops - copied)}"
