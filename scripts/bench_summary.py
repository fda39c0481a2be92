"""Write a benchmark report's summary.json from its raw data.

    python scripts/bench_summary.py RAW.json [RAW.json ...]

Each RAW.json is a report's complete data (a raw.json that `pagedserve bench` wrote under
.cache/bench/, or a results.json of a report from before the raw data left git); summary.json is
written beside it, or, with `--out DIR`, into DIR/<name of RAW.json's folder>/. The summary is
`pagedserve.bench.report.summary` of it: everything but the per-request records and KV timelines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedserve.bench.report import summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", nargs="+", type=Path, help="a report's complete data (JSON)")
    p.add_argument("--out", type=Path, default=None, help="root of the summaries' folders")
    args = p.parse_args(argv)
    for raw in args.raw:
        folder = raw.parent if args.out is None else args.out / raw.resolve().parent.name
        folder.mkdir(parents=True, exist_ok=True)
        data = summary(json.loads(raw.read_text()))
        (folder / "summary.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(folder / "summary.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
