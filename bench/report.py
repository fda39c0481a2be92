"""Reports: results.md (the ratio table with spread), summary.json (ratios, per-peer aggregates,
machine and probes) and PNG plots in the report directory, which is committed; raw.json (the
same plus every raw per-request record and KV timeline) in a raw directory outside git
(docs/benchmarks/README.md, "Report files")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.bench.driver import ScenarioResult


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown(results: list[ScenarioResult], header: dict) -> str:
    lines = [
        f"Run {header['date']} - `{header['command']}` - {header['reps']} interleaved repetitions",
        "",
        "| scenario | ratio | median | min-max | goal | met | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        gate = "pass" if res.valid else "**FAIL (invalid)**"
        ties = len(res.gate.get("near_ties", []))
        if res.valid and ties:
            gate = f"pass ({ties} bf16 near {'tie' if ties == 1 else 'ties'})"
        for r in res.ratios:
            j = r.to_json()
            met = {True: "yes", False: "**no**", None: ""}[r.met]
            lines.append(
                f"| {res.name} | {r.metric} | {_fmt(j['median'])} | {_fmt(j['min'])}-"
                f"{_fmt(j['max'])} | {r.goal} | {met} | {gate} |"
            )
    lines.append("")
    for res in results:
        for note in res.notes:
            lines.append(f"- {res.name}: {note}")
    for res in results:
        if res.name.startswith("S11"):
            lines += ["", *_concurrency_table(res)]
    return "\n".join(lines) + "\n"


def _concurrency_table(res: ScenarioResult) -> list[str]:
    """S11 has no peer ratio: per level, what held and what each process cost."""
    levels = [run for key, run in res.runs.items() if key.startswith("streams=")]
    names = list(levels[0]["processes"]) if levels else []
    head = "| streams | completed | failed | TTFT p99 s | health p99 ms | " + " | ".join(
        f"{n} threads (start-peak) | {n} RSS MiB (start-peak)" for n in names
    )
    lines = [f"{res.name}:", "", head + " |", "|" + "---|" * (5 + 2 * len(names))]
    for run in levels:
        cells = [str(run["streams"]), str(run["completed"]), str(run["failed"]),
                 _fmt(run["ttft"]["p99"]), _fmt(1e3 * (run["health_s"]["p99"] or 0))]  # fmt: skip
        for name in names:
            p = run["processes"][name]
            cells.append(f"{p['start']['threads']}-{p['peak']['threads']}")
            cells.append(f"{p['start']['rss_mib']:.0f}-{p['peak']['rss_mib']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# Keys whose values are raw samples, not aggregates: per-request records and the KV timeline.
RAW_KEYS = frozenset({"requests", "timeline"})


def summary(data: Any) -> Any:
    """`data` without the values of `RAW_KEYS`, at any depth (a new object; `data` is unchanged).
    What is left is what results.md and every reader of a report use: ratios, gates, notes and
    each peer's aggregates (tok/s, TTFT/TPOT/ITL/E2E percentiles, KV, processes)."""
    if isinstance(data, dict):
        return {k: summary(v) for k, v in data.items() if k not in RAW_KEYS}
    if isinstance(data, list):
        return [summary(v) for v in data]
    return data


def write(
    results: list[ScenarioResult], header: dict, out: Path, raw: Path | None = None
) -> list[Path]:
    """Write results.md, summary.json and the plots into `out`, and raw.json into `raw`
    (None: not written). Returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    data = {**header, "scenarios": [r.to_json() for r in results]}
    paths = [out / "results.md", out / "summary.json"]
    paths[0].write_text(markdown(results, header))
    paths[1].write_text(json.dumps(summary(data), indent=1, default=str) + "\n")
    if raw is not None:
        raw.mkdir(parents=True, exist_ok=True)
        paths.append(raw / "raw.json")
        paths[-1].write_text(json.dumps(data, default=str))
    return paths + plot(results, out)


def plot(results: list[ScenarioResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    by_name = {r.name.split()[0]: r for r in results}
    if "S1" in by_name:
        runs = by_name["S1"].runs
        peers = [k for k in runs if not k.endswith("-gate")]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, p in enumerate(peers):
            vals = [o["useful_tok_s"] for o in runs[p]]
            ax.bar(i, sorted(vals)[len(vals) // 2], color=f"C{i}")
            ax.plot([i] * len(vals), vals, "k.")
        ax.set_xticks(range(len(peers)), peers)
        ax.set_ylabel("useful output tok/s")
        ax.set_title("S1 offline throughput (bars: median, dots: repetitions)")
        paths.append(_save(fig, out / "s1_throughput.png"))
    if "S2" in by_name and "curves" in by_name["S2"].runs:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for name, curve in by_name["S2"].runs["curves"].items():
            rates = [c["rate"] for c in curve]
            axes[0].plot(rates, [1e3 * c["p99_tpot"] for c in curve], "o-", label=name)
            axes[1].plot(rates, [c["goodput"] for c in curve], "o-", label=name)
        axes[0].set(xlabel="request rate (req/s)", ylabel="p99 TPOT (ms)")
        axes[1].set(xlabel="request rate (req/s)", ylabel="goodput (req/s)")
        axes[0].legend()
        fig.suptitle("S2 latency vs load")
        paths.append(_save(fig, out / "s2_latency_vs_load.png"))
    if "S3" in by_name:
        runs = by_name["S3"].runs
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
        for ax, name in zip(axes, ("paged", "reserve-max"), strict=True):
            timeline = runs[name][0]["kv"]["timeline"] if name in runs else []
            t = [x[0] for x in timeline]
            ax.plot(t, [x[2] for x in timeline], label="allocated slots")
            ax.plot(t, [x[1] for x in timeline], label="used slots")
            ax.set(xlabel="seconds", ylabel="KV slots", title=f"S3 KV over time ({name})")
            ax.legend()
        paths.append(_save(fig, out / "s3_kv_utilisation.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
