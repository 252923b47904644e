"""Load generation and measurement: the same client, warm-up and statistics for every runtime."""

from .loadgen import MeasureConfig, Point, closed_loop, open_loop, parse_levels, sweep
from .stats import WindowStats, is_stable, percentile, rows_per_s, summarize
from .targets import BatcherTarget, RemoteTarget, RunnerTarget, open_target

__all__ = [
    "BatcherTarget",
    "MeasureConfig",
    "Point",
    "RemoteTarget",
    "RunnerTarget",
    "WindowStats",
    "closed_loop",
    "is_stable",
    "open_loop",
    "open_target",
    "parse_levels",
    "percentile",
    "rows_per_s",
    "summarize",
    "sweep",
]
