"""Sweep results as a terminal table, CSV, JSON and PNG plots."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from .loadgen import Point

__all__ = [
    "goodput_table",
    "machine",
    "markdown_head",
    "plot_latency_vs_throughput",
    "table",
    "write_csv",
    "write_json",
]


def machine() -> str:
    """This machine in a line, for reports (architecture, CPUs, Python)."""
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def markdown_head(title: str, machine: str, command: str) -> list[str]:
    """A Markdown report's first lines: the title, the machine and the command that made it."""
    return [f"# {title}", "", f"Machine: {machine}.", "", "```sh", command, "```", ""]


def table(points: Sequence[Point], title: str = "") -> Table:
    t = Table(
        "mode",
        "level",
        "req/s",
        "infer/s",
        "p50 ms",
        "p90 ms",
        "p95 ms",
        "p99 ms",
        "mean ms",
        "errors",
        "client CPU us/req",
        "server CPU us/req",
        "note",
        title=title,
    )
    for p in points:
        s = p.stats
        notes = [] if p.stable else ["unstable"]
        if p.client_bound:
            notes.append("client-bound")
        t.add_row(
            p.mode,
            f"{p.level:g}",
            f"{s.throughput:.1f}",
            f"{s.inferences_per_s:.1f}",
            f"{s.p50_ms:.1f}",
            f"{s.p90_ms:.1f}",
            f"{s.p95_ms:.1f}",
            f"{s.p99_ms:.1f}",
            f"{s.mean_ms:.1f}",
            str(s.errors),
            f"{p.client_cpu_us:.0f}",
            "-" if math.isnan(p.server_cpu_us) else f"{p.server_cpu_us:.0f}",
            ", ".join(notes),
        )
    return t


def goodput_table(points: Sequence[Point], title: str = "") -> Table:
    """Goodput beside throughput, and what became of the attempts: for a sweep with a
    client deadline or retries (``Point.deadlines``), below ``table``."""
    t = Table(
        "mode", "level", "req/s", "goodput/s", "in time", "sent/s", "timed out", "refused",
        "retried", "errors", title=title,
    )  # fmt: skip
    for p in points:
        s = p.stats
        t.add_row(
            p.mode, f"{p.level:g}", f"{s.throughput:.1f}", f"{s.goodput:.1f}",
            f"{s.goodput_share:.0%}", f"{s.sent_per_s:.1f}", str(s.timed_out),
            str(s.refused), str(s.retried), str(s.errors),
        )  # fmt: skip
    return t


def _clean(value: Any) -> Any:
    """``value`` with every NaN, however deep in dicts and lists, as None (JSON has none)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def write_json(
    series: Mapping[str, Sequence[Point]], path: Path, meta: Mapping[str, Any] | None = None
) -> None:
    data = {
        "meta": _clean(dict(meta or {})),
        "series": {
            name: [{k: _clean(v) for k, v in p.as_dict().items()} for p in pts]
            for name, pts in series.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def write_csv(series: Mapping[str, Sequence[Point]], path: Path) -> None:
    rows = [
        {"series": name, **{k: _clean(v) for k, v in p.as_dict().items() if k != "errors_seen"}}
        for name, pts in series.items()
        for p in pts
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def plot_latency_vs_throughput(
    series: Mapping[str, Sequence[Point]], path: Path, title: str = ""
) -> None:
    """p50 (solid) and p99 (dashed) latency against throughput, one colour per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, (name, points) in enumerate(series.items()):
        color = f"C{i}"
        x = [p.stats.inferences_per_s for p in points]
        ax.plot(x, [p.stats.p50_ms for p in points], "o-", color=color, label=f"{name} p50")
        ax.plot(
            x, [p.stats.p99_ms for p in points], "s--", color=color, alpha=0.7, label=f"{name} p99"
        )
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
