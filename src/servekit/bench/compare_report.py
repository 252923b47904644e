"""``servekit compare``'s report: what was compared (model, load, machine, each runtime's
effective policy), a verdict per figure that names a winner only beyond noise, each figure
with its 95 % interval over the rounds, and where each runtime's time goes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .report import markdown_head
from .verdict import Verdict, interval, judge

if TYPE_CHECKING:
    from .compare import ComparisonResult
    from .loadgen import Point

__all__ = ["FIGURES", "markdown_report", "verdicts"]

FIGURES = (
    ("server CPU per request (us)", lambda p: p.server_cpu_us, False),
    ("p99 latency (ms)", lambda p: p.stats.p99_ms, False),
    ("throughput (rows/s)", lambda p: p.stats.inferences_per_s, True),
)
"""The figures judged, in the order the report gives them: server CPU per request first,
the figure a shared machine disturbs least."""


def _at(rounds: Sequence[Sequence[Point]], level: int) -> list[Point]:
    return [points[level] for points in rounds]


def verdicts(result: ComparisonResult) -> dict[float, list[Verdict]]:
    """Per concurrency level, the verdict on each figure across the runtimes measured."""
    out: dict[float, list[Verdict]] = {}
    any_rounds = next(iter(result.rounds.values()), [])
    if not any_rounds:
        return out
    for i, p in enumerate(any_rounds[0]):
        out[p.level] = [
            judge(
                figure,
                {name: [get(q) for q in _at(r, i)] for name, r in result.rounds.items()},
                higher,
            )
            for figure, get, higher in FIGURES
        ]
    return out


def _num(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def markdown_report(
    result: ComparisonResult, command: str, plot: str | None, machine: str, load: str = ""
) -> str:
    """The comparison as Markdown: what was compared, the verdicts, the table with its
    intervals, where the time goes, what was skipped. Nothing prints NaN: a figure not
    measured is ``-``."""
    n = max((len(r) for r in result.rounds.values()), default=0)
    lines = [
        *markdown_head(f"servekit compare: {result.model}", machine, command),
        f"Model: `{result.model}`. {result.workload}",
        "",
        f"Load: {load or 'closed loop'}; {n} round(s), the runtimes interleaved (each "
        "round starts one runtime later), every runtime started before the first.",
        "",
        "| runtime | effective policy |",
        "| --- | --- |",
        *(f"| {name} | {policy} |" for name, policy in result.policies.items()),
        "",
    ]
    notes = [note for name in result.policies for note in result.notes.get(name, [])]
    if notes:
        lines += ["What a runtime cannot honour:", "", *(f"- {note}" for note in notes), ""]
    lines += ["## Verdicts", ""]
    for level, judged in verdicts(result).items():
        lines += [f"Concurrency {level:g}:", "", *(f"- {v.text}" for v in judged), ""]
    lines += [
        "## Figures (mean ± 95 % interval over the rounds)",
        "",
        "| runtime | concurrency | rows/s | p50 ms | p99 ms | server CPU us/request "
        "| client CPU us/request | stable rounds | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rounds in result.rounds.items():
        if not rounds:
            continue
        for i, first in enumerate(rounds[0]):
            at = _at(rounds, i)
            cells = [
                interval([p.stats.inferences_per_s for p in at]).text(1),
                interval([p.stats.p50_ms for p in at]).text(2),
                interval([p.stats.p99_ms for p in at]).text(2),
                interval([p.server_cpu_us for p in at]).text(),
                interval([p.client_cpu_us for p in at]).text(),
                f"{sum(p.stable for p in at)}/{len(at)}",
                str(sum(p.stats.errors for p in at)),
            ]
            lines.append(f"| {name} | {first.level:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "A round is stable when its last three windows agreed within the tolerance; an "
        "unstable round still counts, and the interval carries its spread.",
    ]
    shares = result.share_of_raw()
    if result.ceiling:
        by_batch = ", ".join(f"{b}: {v:,.1f}" for b, v in (result.ceiling_by_batch or {}).items())
        lines += [
            "",
            f"Raw ceiling: {result.ceiling:,.1f} rows/s, the in-process model at its best "
            f"batch size (by batch: {by_batch}).",
        ]
    if shares:
        lines += [
            "",
            "Best throughput (median round) as a share of "
            + ("the raw ceiling: " if result.ceiling else "`raw`'s best: ")
            + ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
            + ".",
        ]
    lines += _time_spent(result)
    if result.skipped:
        lines += [
            "",
            "Skipped: " + "; ".join(f"{k} ({v})" for k, v in result.skipped.items()) + ".",
        ]
    if plot:
        lines += ["", f"![latency against throughput]({plot})"]
    return "\n".join(lines) + "\n"


def _time_spent(result: ComparisonResult) -> list[str]:
    """Where the time goes, per request: the model's queue and compute (its own
    statistics), and the server's CPU by process (the processes costing most)."""
    if not result.time_spent:
        return []
    lines = [
        "",
        "## Where the time goes (all levels and rounds)",
        "",
        "| runtime | queue us (a request's wait) | compute us (its batch's) "
        "| server CPU us per request, by process |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, spent in result.time_spent.items():
        cpu = sorted(
            ((k.removeprefix("CPU: "), v) for k, v in spent.items() if k.startswith("CPU: ")),
            key=lambda kv: -kv[1],
        )
        shown = [f"{proc} {us:,.0f}" for proc, us in cpu[:4] if us >= 0.5]
        by_process = ", ".join(shown) or "- (in this process)"
        queue, compute = spent.get("queue", math.nan), spent.get("compute", math.nan)
        lines.append(f"| {name} | {_num(queue)} | {_num(compute)} | {by_process} |")
    lines += [
        "",
        "Queue and compute are means of the model's own statistics (`/v2/models/<m>/stats`, "
        "or the Batcher's counters) over every request of the rounds, warm-up included; a "
        "runtime that keeps none is left out. The CPU is the server's process tree, by "
        "process name, over the same requests.",
    ]
    return lines
