"""Measure one candidate: start ``servekit serve --config`` with it on loopback, sweep
client concurrency with servekit's load generator, watch the process tree's memory, stop.

The sweep stops early once a level breaks the p99 budget (in a closed loop, more clients
only add queueing) or gains less than ``plateau`` over the best level so far, as Model
Analyzer stops a concurrency sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..bench.compare import ServerProcess, Setup, target_url
from ..bench.cpu import PeakRss
from ..bench.loadgen import MeasureConfig, Point, closed_loop
from ..bench.targets import open_target
from ..config import ServeConfig
from .search import Constraints, Trial
from .space import Knobs

__all__ = ["Measurement", "measure"]


@dataclass(frozen=True)
class Measurement:
    """How each candidate is measured."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    window: MeasureConfig = MeasureConfig(window_s=2.0, warmup_s=1.0, max_windows=6)
    plateau: float = 0.05
    """A level that adds less than this share of throughput ends the sweep."""
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {list(self.concurrency)}")
        object.__setattr__(self, "concurrency", tuple(sorted(set(self.concurrency))))


def _why_it_failed(server: ServerProcess, exc: BaseException) -> str:
    """The server log's last error line (or the exception), one line."""
    lines = [ln.strip() for ln in server.log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    line = (errors or lines or [f"{type(exc).__name__}: {exc}"])[-1]
    return line[:400]


def measure(
    config: ServeConfig,
    knobs: Knobs,
    setup: Setup,
    how: Measurement,
    constraints: Constraints,
) -> Trial:
    """One candidate (``config`` is already the candidate's) as a judged ``Trial``; a
    runtime that does not start or answer is a ``failed`` trial, never an exception.
    Ctrl-C stops the server and propagates."""
    trial = Trial(knobs)
    started = time.monotonic()
    served = config.on_loopback()
    with ServerProcess(served) as server:
        with PeakRss(server.pid) as rss:
            try:
                server.wait_ready([setup.target], how.start_timeout_s)
                with _ctrl_c_raises():
                    sweep = _sweep(served, server.pid, setup, how, constraints)
                    trial.points = asyncio.run(sweep)
            except (RuntimeError, TimeoutError, OSError) as exc:
                trial.status, trial.reason = "failed", _why_it_failed(server, exc)
            except Exception as exc:  # noqa: BLE001 - a candidate's failure is reported, not fatal
                trial.status, trial.reason = "failed", f"{type(exc).__name__}: {exc}"[:400]
        trial.peak_rss_mb = rss.peak / 2**20
    trial.seconds = time.monotonic() - started
    return trial.judge(constraints)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` where it lands, inside the event loop too.
    ``asyncio.run``'s own handler only cancels the main task, and a cancellation that
    meets a finishing ``wait_for`` (Python 3.11) is lost: the candidate would run on. A
    SIGINT the process ignores (started in the background) stays ignored."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    previous = signal.signal(signal.SIGINT, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def _sweep(
    config: ServeConfig, pid: int, setup: Setup, how: Measurement, constraints: Constraints
) -> list[Point]:
    target = open_target(target_url(config), setup.target, setup.payload)
    window = dataclasses.replace(how.window, server_pid=pid)
    points: list[Point] = []
    try:
        for level in how.concurrency:
            point = await closed_loop(target, level, window)
            points.append(point)
            best = max(p.stats.inferences_per_s for p in points[:-1]) if len(points) > 1 else 0.0
            over_budget = constraints.p99_ms is not None and point.stats.p99_ms > constraints.p99_ms
            flat = best > 0 and point.stats.inferences_per_s < best * (1 + how.plateau)
            if over_budget or flat or point.stats.errors:
                break
    finally:
        await target.close()
    return points
