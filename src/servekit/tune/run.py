"""``tune``: search one runtime's configurations for one model under constraints.

Every candidate is recorded as it finishes, so Ctrl-C (which stops the running server)
still leaves every finished trial to report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..bench.compare import Setup
from ..config import RayOptions, ServeConfig
from .measure import Measurement, measure
from .search import Constraints, Trial, best_trial, brute, quick
from .space import Knobs, SearchSpace

__all__ = ["SEARCHES", "TuneResult", "as_dict", "baseline_knobs", "for_runtime", "tune"]

SEARCHES = ("quick", "brute")

OVERLAPPING = ("pytriton", "triton", "ray")
"""The runtimes whose instances overlap a batch's hand-over with the device (``overlap``)."""


@dataclass
class TuneResult:
    """What one runtime's search measured, and what it found."""

    base: ServeConfig
    space: SearchSpace
    constraints: Constraints
    search: str
    trials: list[Trial] = field(default_factory=list)
    baseline: Trial | None = None
    """The base configuration's own knobs, measured first for comparison."""
    adaptive: Trial | None = None
    """With a p99 budget: the best trial's max batch size and instances with the batcher
    holding that budget itself (``latency_budget_ms``) instead of a fixed delay."""
    interrupted: bool = False

    @property
    def runtime(self) -> str:
        return self.base.runtime

    @property
    def best(self) -> Trial | None:
        """The best trial under the constraints; the baseline counts too, so tuning never
        recommends less than the configuration it started from (as Model Analyzer keeps
        the default configuration among its candidates)."""
        candidates = [*self.trials, *([self.baseline] if self.baseline else [])]
        return best_trial(candidates, self.constraints)

    def best_config(self) -> ServeConfig | None:
        """What ``best.toml`` holds: the base config with the best trial's knobs (the base
        itself when the baseline is best)."""
        best = self.best
        if best is None:
            return None
        return self.base if best is self.baseline else self.space.config(self.base, best.knobs)


def baseline_knobs(base: ServeConfig) -> Knobs:
    """The knobs ``base`` sets itself (max batch size 0 = the model's own)."""
    (model,) = base.models
    return Knobs(
        model.batching.max_batch_size,
        model.instances,
        model.batching.max_queue_delay_us,
        model.threads,
        model.overlap,
    )


def for_runtime(base: ServeConfig, runtime: str) -> ServeConfig:
    """``base`` for ``runtime``; on Ray with default options, half a CPU per model replica
    so two replicas and the stages fit a 2-CPU machine, as ``servekit compare`` runs it."""
    ray = RayOptions()
    if runtime == "ray":
        ray = base.ray if base.ray != RayOptions() else RayOptions(model_cpus=0.5)
    return base.replace(runtime=runtime, ray=ray)


def tune(
    base: ServeConfig,
    space: SearchSpace,
    constraints: Constraints,
    how: Measurement,
    *,
    search: str = "quick",
    baseline: bool = True,
    on_start: Callable[[str, Knobs], None] = lambda _label, _knobs: None,
    on_trial: Callable[[TuneResult, Trial], None] = lambda _result, _trial: None,
) -> TuneResult:
    """Search ``space`` for ``base``'s one model on ``base.runtime``; with ``baseline``,
    first measure ``base``'s own knobs. Ctrl-C ends the search with ``interrupted`` set."""
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {list(SEARCHES)}, got {search!r}")
    if len(base.models) != 1:
        raise ValueError(f"tune takes one model, got {len(base.models)}")
    if base.runtime not in OVERLAPPING:  # the knob means nothing there: one value
        space = dataclasses.replace(space, overlap=(base.models[0].overlap,))
    result = TuneResult(base, space, constraints, search)
    setup = Setup.of(base.models[0])

    def evaluate(knobs: Knobs) -> Trial:
        on_start("candidate", knobs)
        trial = measure(space.config(base, knobs), knobs, setup, how, constraints)
        result.trials.append(trial)
        on_trial(result, trial)
        return trial

    try:
        if baseline:
            knobs = baseline_knobs(base)
            on_start("baseline", knobs)
            result.baseline = measure(base, knobs, setup, how, constraints)
            on_trial(result, result.baseline)
        if search == "brute":
            brute(space, evaluate)
        else:
            quick(space, evaluate, constraints)
        budget = constraints.p99_ms
        if budget is not None:
            chosen = result.best or result.baseline
            knobs = chosen.knobs if chosen else baseline_knobs(base)
            on_start("adaptive", knobs)
            adaptive = space.adaptive(base, knobs, budget)
            result.adaptive = measure(adaptive, knobs, setup, how, constraints)
            on_trial(result, result.adaptive)
    except KeyboardInterrupt:
        result.interrupted = True
    return result


def as_dict(result: TuneResult) -> dict[str, object]:
    """The result as plain data (the report's JSON)."""

    def trial(t: Trial) -> dict[str, object]:
        return {
            "knobs": dataclasses.asdict(t.knobs),
            "status": t.status,
            "reason": t.reason,
            "peak_rss_mb": t.peak_rss_mb,
            "seconds": t.seconds,
            "best": t.best.as_dict() if t.best else None,
            "points": [p.as_dict() for p in t.points],
        }

    return {
        "runtime": result.runtime,
        "search": result.search,
        "space": dataclasses.asdict(result.space),
        "constraints": dataclasses.asdict(result.constraints),
        "interrupted": result.interrupted,
        "baseline": trial(result.baseline) if result.baseline else None,
        "adaptive": trial(result.adaptive) if result.adaptive else None,
        "trials": [trial(t) for t in result.trials],
    }
