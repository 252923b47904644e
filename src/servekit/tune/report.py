"""What ``servekit tune`` writes: ``best.toml`` (and the config.pbtxt it implies on the
Triton runtimes), ``report.md`` with every candidate, ``trials.json`` and the plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from ..bench.loadgen import Point
from ..bench.report import markdown_head
from .run import TuneResult, as_dict
from .search import Trial

__all__ = ["pareto_front", "write_outputs"]


def representative(trial: Trial) -> Point | None:
    """The point a candidate is plotted and listed by: its best under the constraints,
    else its highest throughput."""
    if trial.best is not None:
        return trial.best
    return max(trial.points, key=lambda p: p.stats.inferences_per_s, default=None)


def pareto_front(trials: Sequence[Trial]) -> list[Trial]:
    """The trials no other trial beats on both throughput (higher) and p99 (lower)."""
    measured = [(t, p) for t in trials if (p := representative(t)) is not None]
    front = []
    for t, p in measured:
        dominated = any(
            q.stats.inferences_per_s >= p.stats.inferences_per_s
            and q.stats.p99_ms <= p.stats.p99_ms
            and (q.stats.inferences_per_s, q.stats.p99_ms)
            != (p.stats.inferences_per_s, p.stats.p99_ms)
            for _, q in measured
        )
        if not dominated:
            front.append(t)
    return front


def _fmt(value: float, spec: str = ".1f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _row(label: str, t: Trial, front: Sequence[Trial]) -> str:
    p = representative(t)
    figures = (
        [
            f"{p.level:g}",
            _fmt(p.stats.inferences_per_s),
            _fmt(p.stats.p50_ms),
            _fmt(p.stats.p95_ms),
            _fmt(p.stats.p99_ms),
            _fmt(p.server_cpu_us, ".0f"),
        ]
        if p is not None
        else ["-"] * 6
    )
    status = t.status + (" (Pareto)" if t in front else "")
    return (
        "| "
        + " | ".join(
            [
                label,
                t.knobs.label(),
                status,
                *figures,
                _fmt(t.peak_rss_mb, ".0f"),
                f"{t.seconds:.0f}",
                t.reason.replace("|", "/") or "-",
            ]
        )
        + " |"
    )


_HEADER = (
    "| # | candidate | status | concurrency | rows/s | p50 ms | p95 ms | p99 ms "
    "| server CPU us/request | peak MB | s | why |\n"
    "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)


def _section(result: TuneResult, folder: str) -> list[str]:
    front = pareto_front(result.trials)
    best = result.best
    lines = [f"## {result.runtime}", ""]
    if result.interrupted:
        lines += ["Interrupted (Ctrl-C): the search stopped; these are the trials it finished.", ""]
    if best is None:
        lines += ["No candidate met the constraints, so no `best.toml` was written.", ""]
    else:
        p = best.best
        assert p is not None
        lines += [
            f"Best: **{best.knobs.label()}**, {p.stats.inferences_per_s:.1f} rows/s at "
            f"concurrency {p.level:g} (p99 {p.stats.p99_ms:.1f} ms, server CPU "
            f"{_fmt(p.server_cpu_us, '.0f')} us/request, peak {best.peak_rss_mb:.0f} MB): "
            f"`{folder}best.toml`.",
            "",
        ]
        base = result.baseline.best if result.baseline else None
        if best is result.baseline:
            lines += ["No candidate beat the baseline, the configuration's own knobs.", ""]
        elif base is not None:
            lines += [
                f"Baseline (the configuration's own knobs, {result.baseline.knobs.label()}): "  # type: ignore[union-attr]
                f"{base.stats.inferences_per_s:.1f} rows/s, p99 {base.stats.p99_ms:.1f} ms; "
                f"tuned/baseline throughput {p.stats.inferences_per_s / base.stats.inferences_per_s:.2f}x.",
                "",
            ]
        elif result.baseline is not None:
            lines += [
                f"Baseline ({result.baseline.knobs.label()}): {result.baseline.status}, "
                f"{result.baseline.reason}.",
                "",
            ]
    lines += _adaptive(result)
    lines += [
        f"{len(result.trials)} trials ({result.search} search over {result.space.size} points).",
        "",
        _HEADER,
    ]
    if result.baseline is not None:
        lines.append(_row("baseline", result.baseline, ()))
    lines += [_row(str(i), t, front) for i, t in enumerate(result.trials, 1)]
    lines += [
        "",
        f"![throughput against p99]({folder}pareto.png) ![peak memory]({folder}memory.png)",
        "",
    ]
    return lines


def _adaptive(result: TuneResult) -> list[str]:
    """The batcher holding the p99 budget itself, against the best fixed configuration."""
    adaptive = result.adaptive
    if adaptive is None:
        return []
    k = adaptive.knobs
    batch = k.max_batch_size or "the model's own"
    what = (
        f"Adaptive batching (`latency_budget_ms = {result.constraints.p99_ms:g}`, batch "
        f"{batch}, instances {k.instances})"
    )
    p = adaptive.best
    if p is None:
        return [f"{what}: {adaptive.status}, {adaptive.reason}.", ""]
    line = (
        f"{what}: {p.stats.inferences_per_s:.1f} rows/s at concurrency {p.level:g}, "
        f"p99 {p.stats.p99_ms:.1f} ms"
    )
    best = result.best.best if result.best else None
    if best is not None:
        line += (
            f"; {p.stats.inferences_per_s / best.stats.inferences_per_s:.2f}x the best fixed "
            f"configuration's rows/s ({best.stats.inferences_per_s:.1f}, p99 "
            f"{best.stats.p99_ms:.1f} ms)"
        )
    return [line + ".", ""]


def _plots(result: TuneResult, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = pareto_front(result.trials)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, t in enumerate(result.trials, 1):
        p = representative(t)
        if p is None:
            continue
        style = {"ok": "o", "pruned": "x"}.get(t.status, "s")
        ax.plot(p.stats.inferences_per_s, p.stats.p99_ms, style, color="C1" if t in front else "C0")
        ax.annotate(str(i), (p.stats.inferences_per_s, p.stats.p99_ms), fontsize=7)
    line = sorted(
        (p for t in front if (p := representative(t)) is not None),
        key=lambda p: p.stats.inferences_per_s,
    )
    ax.plot(
        [p.stats.inferences_per_s for p in line],
        [p.stats.p99_ms for p in line],
        "-",
        color="C1",
        label="Pareto front",
    )
    if result.constraints.p99_ms:
        ax.axhline(result.constraints.p99_ms, color="C3", ls="--", label="p99 budget")
    ax.set_xlabel("throughput (rows/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title(f"servekit tune: {result.base.models[0].name} on {result.runtime}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "pareto.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    ax.bar(
        [str(i) for i in range(1, len(result.trials) + 1)],
        [0 if math.isnan(t.peak_rss_mb) else t.peak_rss_mb for t in result.trials],
    )
    ax.set_xlabel("candidate (report.md's #)")
    ax.set_ylabel("peak memory of the server tree (MB)")
    fig.tight_layout()
    fig.savefig(folder / "memory.png")
    plt.close(fig)


def write_best(result: TuneResult, folder: Path) -> list[Path]:
    """``best.toml`` and, on the Triton runtimes, the tuned model's config.pbtxt."""
    config = result.best_config()
    if config is None:
        return []
    written = [folder / "best.toml"]
    written[0].write_text(config.to_toml())
    if result.runtime in ("triton", "pytriton"):
        from ..protocol.pbtxt import render
        from ..triton.repo import model_repository

        model = model_repository(config.replace(runtime="triton"))[0]
        written.append(folder / "config.pbtxt")
        written[-1].write_text(render(model.config))
    return written


def write_outputs(
    results: Sequence[TuneResult], out: Path, command: str, machine: str
) -> list[Path]:
    """Everything, under ``out`` (one runtime) or ``out/<runtime>/`` each (several), with
    one ``out/report.md``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    lines = markdown_head(f"servekit tune: {results[0].base.models[0].name}", machine, command)
    c = results[0].constraints
    lines += [
        f"Objective: {c.objective}; constraints: p99 <= {c.p99_ms or '-'} ms, "
        f"throughput >= {c.min_throughput or '-'} rows/s, no errors. Each candidate is served "
        "by `servekit serve --config` on loopback and measured in a closed loop at rising "
        "concurrency until the p99 budget breaks or throughput stops growing; its figures "
        "are its best level under the constraints.",
        "",
    ]
    if len(results) > 1:
        lines += [
            "| runtime | best candidate | rows/s | p99 ms | server CPU us/request "
            "| baseline rows/s | trials |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in results:
            b = r.best
            base = r.baseline.best if r.baseline else None
            lines.append(
                f"| {r.runtime} | {b.knobs.label() if b else 'none met the constraints'} | "
                f"{_fmt(b.best.stats.inferences_per_s) if b and b.best else '-'} | "
                f"{_fmt(b.best.stats.p99_ms) if b and b.best else '-'} | "
                f"{_fmt(b.best.server_cpu_us, '.0f') if b and b.best else '-'} | "
                f"{_fmt(base.stats.inferences_per_s) if base else '-'} | {len(r.trials)} |"
            )
        lines.append("")
    written: list[Path] = []
    for r in results:
        folder = out / r.runtime if len(results) > 1 else out
        prefix = f"{r.runtime}/" if len(results) > 1 else ""
        folder.mkdir(parents=True, exist_ok=True)
        written += write_best(r, folder)
        if r.trials:
            _plots(r, folder)
            written += [folder / "pareto.png", folder / "memory.png"]
        (folder / "trials.json").write_text(json.dumps(_clean(as_dict(r)), indent=1))
        written.append(folder / "trials.json")
        lines += _section(r, prefix)
    (out / "report.md").write_text("\n".join(lines))
    written.append(out / "report.md")
    return written


def _clean(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value
