"""``servekit tune``: the best configuration of a model on each runtime, under constraints."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..config import RUNTIMES
from .common import CacheDir, ConfigFile, console, fail, model_source, serve_config

if TYPE_CHECKING:
    from ..tune import Knobs, Trial, TuneResult

__all__ = ["tune"]


def _values(text: str, option: str, *, allow_default: bool = False) -> tuple[int | None, ...]:
    out: list[int | None] = []
    for item in text.replace(" ", "").split(","):
        if allow_default and item == "default":
            out.append(None)
            continue
        try:
            out.append(int(item))
        except ValueError:
            raise typer.BadParameter(
                f"expected comma-separated integers{' or default' if allow_default else ''}, "
                f"got {text!r}",
                param_hint=option,
            ) from None
    return tuple(out)


def _switches(text: str, option: str) -> tuple[bool | None, ...]:
    words = {"on": True, "off": False, "auto": None}
    items = text.replace(" ", "").split(",")
    if any(i not in words for i in items):
        raise typer.BadParameter(f"expected auto, on or off, got {text!r}", param_hint=option)
    return tuple(words[i] for i in items)


def tune(
    model: Annotated[str | None, typer.Option(help="Zoo model or ONNX file (or --config).")] = None,
    config: ConfigFile = None,
    runtime: Annotated[
        str | None,
        typer.Option(help="native, pytriton, triton, ray or all (default: the config's)."),
    ] = None,
    latency_budget_ms: Annotated[
        float | None, typer.Option(min=0.001, help="p99 budget in milliseconds.")
    ] = None,
    min_throughput: Annotated[
        float | None, typer.Option(min=0.001, help="Rows per second a candidate must reach.")
    ] = None,
    objective: Annotated[str, typer.Option(help="throughput or latency (p99).")] = "throughput",
    search: Annotated[
        str, typer.Option(help="quick (hill climb) or brute (every point).")
    ] = "quick",
    max_batch_sizes: Annotated[str, typer.Option(help="Values to try.")] = "1,4,8,16",
    instances: Annotated[str, typer.Option(help="Values to try.")] = "1,2",
    max_queue_delay_us: Annotated[str, typer.Option(help="Values to try.")] = "0,500,2000",
    threads: Annotated[
        str, typer.Option(help="ONNX Runtime threads per instance to try ('default' = ORT's).")
    ] = "1",
    overlap: Annotated[
        str,
        typer.Option(
            help="[models] overlap values to try (auto, on, off); the Triton runtimes and Ray."
        ),
    ] = "off,on",
    concurrency: Annotated[
        str, typer.Option(help="Client concurrency levels each candidate is swept over.")
    ] = "1,2,4,8,16,32",
    window: Annotated[float, typer.Option(help="Measurement window, seconds.")] = 2.0,
    warmup: Annotated[float, typer.Option(help="Warm-up before each level, seconds.")] = 1.0,
    max_windows: Annotated[int, typer.Option(min=3)] = 6,
    baseline: Annotated[
        bool, typer.Option(help="Also measure the configuration's own knobs, for comparison.")
    ] = True,
    out: Annotated[
        Path, typer.Option(help="Writes best.toml, report.md, trials.json and plots here.")
    ] = Path("tune"),
    cache_dir: CacheDir = None,
) -> None:
    """Search max batch size, instances, queue delay and threads (Model Analyzer's knobs),
    and on the Triton runtimes whether an instance overlaps the next batch's hand-over,
    for the configuration with the best throughput (or p99) under a p99 budget and/or a
    minimum throughput: each candidate is served on loopback, swept over client
    concurrency and stopped. Writes OUT/best.toml for `servekit serve --config`, the
    config.pbtxt it implies (Triton runtimes), report.md and plots; --runtime all tunes
    each runtime and reports them side by side. Ctrl-C writes the report so far."""
    import shlex
    import sys

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from ..bench import MeasureConfig, parse_levels
    from ..bench.report import machine
    from ..tune import (
        Constraints,
        Measurement,
        SearchSpace,
        for_runtime,
        write_outputs,
    )
    from ..tune import tune as run_tune

    if (model is None) == (config is None):
        raise typer.BadParameter("give exactly one of --model or --config")
    runtimes = list(RUNTIMES) if runtime == "all" else [runtime] if runtime else []
    if any(r not in RUNTIMES for r in runtimes):
        raise typer.BadParameter(
            f"must be one of {[*RUNTIMES, 'all']}, got {runtime!r}", param_hint="--runtime"
        )
    base = serve_config(
        config, models=[model_source(model, cache_dir)] if model else None, cache_dir=cache_dir
    )
    if len(base.models) != 1:
        raise typer.BadParameter(f"tune takes one model; the config has {len(base.models)}")
    try:
        space = SearchSpace(
            _values(max_batch_sizes, "--max-batch-sizes"),  # type: ignore[arg-type]
            _values(instances, "--instances"),  # type: ignore[arg-type]
            _values(max_queue_delay_us, "--max-queue-delay-us"),  # type: ignore[arg-type]
            _values(threads, "--threads", allow_default=True),
            _switches(overlap, "--overlap"),
        )
        constraints = Constraints(latency_budget_ms, min_throughput, objective)
        how = Measurement(
            tuple(int(c) for c in parse_levels(concurrency)),
            MeasureConfig(window_s=window, warmup_s=warmup, max_windows=max_windows),
        )
        configs = [for_runtime(base, r) for r in runtimes or [base.runtime]]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    results: list[TuneResult] = []
    most = space.size + baseline  # quick usually stops well before
    with Progress(
        SpinnerColumn(),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        for cfg in configs:
            rt = cfg.runtime
            task = progress.add_task(rt, total=most)
            line = _ProgressLine(progress, task, rt)

            result = run_tune(
                cfg,
                space,
                constraints,
                how,
                search=search,
                baseline=baseline,
                on_start=line.started,
                on_trial=line.finished,
            )
            results.append(result)
            progress.update(task, completed=most)
            if result.interrupted:
                break
    command = "servekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_outputs(results, out, command, machine())
    for r in results:
        best = r.best
        where = out / r.runtime if len(results) > 1 else out
        console.print(
            f"{r.runtime}: "
            + (
                f"best {best.knobs.label()} -> {where / 'best.toml'}"
                if best
                else "no candidate met the constraints"
            )
        )
    console.print(f"wrote {out / 'report.md'}")
    if results and results[-1].interrupted:
        raise fail("interrupted; the report holds the trials finished so far", 130)


class _ProgressLine:
    """One runtime's progress line: the candidate being measured beside the best so far,
    and each finished trial printed above it."""

    def __init__(self, progress: Any, task: Any, runtime: str) -> None:
        self.progress, self.task, self.runtime = progress, task, runtime
        self.best = "no candidate yet"

    def started(self, label: str, knobs: Knobs) -> None:
        self.progress.update(
            self.task,
            description=f"{self.runtime}: measuring {label} {knobs.label()} | {self.best}",
        )

    def finished(self, result: TuneResult, trial: Trial) -> None:
        p = trial.best
        figures = (
            f"{p.stats.inferences_per_s:.1f} rows/s at concurrency {p.level:g}, "
            f"p99 {p.stats.p99_ms:.1f} ms"
            if p
            else trial.reason
        )
        best = result.best
        self.best = (
            f"best so far: {best.knobs.label()} ({best.best.stats.inferences_per_s:.1f} rows/s)"  # type: ignore[union-attr]
            if best
            else "no candidate meets the constraints yet"
        )
        self.progress.console.print(
            f"{self.runtime}: {trial.knobs.label()}: {trial.status}, {figures}"
        )
        self.progress.update(self.task, advance=1, description=f"{self.runtime}: {self.best}")
