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


def test_the_image_installs_the_client_distribution_before_pagedserve():
    # NOTE: pagedserve depends on pagedserve-client, which no package index has
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    assert "COPY clients/python ./clients/python" in lines
    client = lines.index("RUN pip install ./clients/python")
    (pagedserve,) = [i for i, line in enumerate(lines) if line.startswith("RUN pip install . ")]
    assert client < pagedserve
