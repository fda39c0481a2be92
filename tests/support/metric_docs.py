"""The metric names docs/metrics.md documents, read from its tables: the chart's dashboard and the
end-to-end metrics test check what they use and what a scrape shows against them."""

from __future__ import annotations

import re
from pathlib import Path

METRICS_MD = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_metrics(section: str | None = None, *, optional: bool = True) -> set[str]:
    """Every metric name in docs/metrics.md's tables ({a,b} alternatives expanded, labels
    dropped, `pagedserve:` prefixed); `section`: only under that `## ` heading. `optional`
    False leaves out the rows whose meaning starts "only with" (a flag turns them on)."""
    text = METRICS_MD.read_text()
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    rows = re.findall(r"^\| (.+?) \| \w+ \| (.*)\|$", text, flags=re.MULTILINE)
    for cell, meaning in rows:
        if not optional and meaning.startswith("only with"):
            continue
        for token in re.findall(r"`([^`]+)`", cell):
            pending = [re.sub(r"\{[a-z_, ]+\}$", "", token)]  # `name{label}`
            while pending:
                name = pending.pop()
                match = re.search(r"\{([a-z_,]+)\}", name)
                if match is None:
                    names.add(name if name.startswith("pagedserve:") else f"pagedserve:{name}")
                    continue
                for part in match.group(1).split(","):
                    pending.append(name[: match.start()] + part + name[match.end() :])
    return names
