"""The load generator: closed loop at a concurrency, open loop at a Poisson request rate.

Each point warms up, then measures windows until the last three agree on throughput
and p95 latency within a tolerance (perf_analyzer's method) or a window budget runs
out. Open-loop latency counts from the moment a request was due, not when it was
sent, so a client that falls behind shows up as latency instead of hiding it
(coordinated omission); the point also reports when the client itself was the limit.
With ``timeout_ms`` clients give up on an answer that has not come in time and, with
``retries``, send the request again (``deadline``); the point then reports goodput, the
answers delivered before their client's deadline, beside throughput.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .cpu import TreeCpu
from .deadline import Outcome, request
from .stats import WindowStats, is_stable, summarize
from .targets import Target

__all__ = ["MeasureConfig", "Point", "closed_loop", "open_loop", "parse_levels", "sweep"]

CLIENT_BOUND_CORES = 0.85
"""Client CPU (in cores) above which a point against a remote target is flagged client-bound."""


@dataclass(frozen=True)
class MeasureConfig:
    window_s: float = 5.0
    warmup_s: float = 2.0
    max_windows: int = 10
    stability: float = 0.1
    stable_windows: int = 3
    rows_per_request: int = 1
    max_in_flight: int = 2048
    """Open loop: requests outstanding at once before the client counts itself saturated."""
    server_pid: int | None = None
    """The server's process: its whole tree's CPU is measured per request (same host only)."""
    timeout_ms: float | None = None
    """Each client's deadline: it gives up on an attempt with no answer after this long
    (closing its connection, cancelling its call) and the request carries it as the KServe
    ``timeout`` parameter; a request's deadline counts from when it was first sent (open
    loop: due). None: clients wait for every answer."""
    retries: int = 0
    """A request that timed out or was refused (503 / UNAVAILABLE) is sent again up to
    this many more times, after a refusal once its ``Retry-After`` (capped by the time
    left before the deadline) has passed."""

    def __post_init__(self) -> None:
        # Written so NaN fails too: a window of NaN seconds never ends.
        if not (0 < self.window_s < math.inf and 0 <= self.warmup_s < math.inf):
            raise ValueError(
                f"window_s must be > 0 and warmup_s >= 0, got {self.window_s}, {self.warmup_s}"
            )
        if not 0 <= self.stability < math.inf:
            raise ValueError(f"stability must be >= 0, got {self.stability}")
        if self.timeout_ms is not None and not 0 < self.timeout_ms < math.inf:
            raise ValueError(f"timeout_ms must be a positive number of ms, got {self.timeout_ms}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.max_windows < self.stable_windows:
            raise ValueError(
                f"max_windows ({self.max_windows}) must be >= stable_windows ({self.stable_windows})"
            )


@dataclass(frozen=True)
class Point:
    """One level of a sweep, merged over its last ``stable_windows`` windows."""

    mode: str
    """``concurrency`` or ``rate``."""
    level: float
    stats: WindowStats
    windows: int
    stable: bool
    client_cpu: float
    """CPU the client process used, in cores (all its threads)."""
    client_bound: bool
    """The client was the limit: it used nearly a core (remote targets), or an open loop
    fell behind its schedule or hit max_in_flight."""
    achieved_rate: float
    error_messages: tuple[str, ...] = field(default_factory=tuple)
    client_cpu_us: float = float("nan")
    """Client CPU per request answered, microseconds (the whole client process)."""
    server_cpu_us: float = float("nan")
    """Server CPU per request answered, microseconds: the CPU time of the server's whole
    process tree (``MeasureConfig.server_pid``); NaN when not measured."""
    timeout_ms: float | None = None
    """The clients' deadline (``MeasureConfig.timeout_ms``); None: they waited."""
    retries: int = 0
    """How many times a request could be sent again (``MeasureConfig.retries``)."""

    @property
    def deadlines(self) -> bool:
        """Measured with a client deadline or retries: goodput is worth reporting."""
        return self.timeout_ms is not None or self.retries > 0

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "level": self.level,
            **self.stats.as_dict(),
            "windows": self.windows,
            "stable": self.stable,
            "client_cpu": self.client_cpu,
            "client_bound": self.client_bound,
            "achieved_rate": self.achieved_rate,
            "client_cpu_us": self.client_cpu_us,
            "server_cpu_us": self.server_cpu_us,
            "timeout_ms": self.timeout_ms,
            "retries": self.retries,
            "errors_seen": list(self.error_messages),
        }


def parse_levels(spec: str) -> list[float]:
    """``"1:16:2"`` (start:end:step, end included, as perf_analyzer), ``"1:16:x2"`` (doubling),
    or ``"1,2,4,8"``."""
    try:
        if "," in spec or ":" not in spec:
            levels = [float(s) for s in spec.split(",")]
        else:
            parts = spec.split(":")
            if len(parts) not in (2, 3):
                raise ValueError
            start, end = float(parts[0]), float(parts[1])
            step = parts[2] if len(parts) == 3 else "1"
            levels = []
            x = start
            if step.startswith("x"):
                factor = float(step[1:])
                if factor <= 1:
                    raise ValueError
                while x <= end + 1e-9:
                    levels.append(x)
                    x *= factor
            else:
                inc = float(step)
                if inc <= 0:
                    raise ValueError
                while x <= end + 1e-9:
                    levels.append(x)
                    x += inc
    except ValueError:
        raise ValueError(
            f"bad range {spec!r}: use start:end:step, start:end:xFACTOR or a,b,c"
        ) from None
    if not levels:
        raise ValueError(f"bad range {spec!r}: its start is past its end")
    if not all(0 < v < math.inf for v in levels):  # NaN fails both comparisons
        raise ValueError(f"bad range {spec!r}: levels must be positive numbers")
    return [int(v) if v == int(v) else v for v in levels]


class _Recorder:
    """Each request as it ends: its latency and what became of its attempts."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.outcomes: list[Outcome] = []
        self.errors: dict[str, int] = {}

    def add(self, latency: float, outcome: Outcome) -> None:
        self.latencies.append(latency)
        self.outcomes.append(outcome)
        error = outcome.error
        if error is not None and len(self.errors) < 5:
            key = f"{type(error).__name__}: {error}"[:300]
            self.errors[key] = self.errors.get(key, 0) + 1

    def window(self, start: int, end: int, duration: float, rows: int) -> WindowStats:
        ended = self.outcomes[start:end]
        lat = [x for x, o in zip(self.latencies[start:end], ended, strict=True) if o.error is None]
        return summarize(
            lat, len(ended) - len(lat), duration, rows,
            sent=sum(o.attempts for o in ended), timed_out=sum(o.timed_out for o in ended),
            refused=sum(o.refused for o in ended), in_time=sum(o.in_time for o in ended),
        )  # fmt: skip


@dataclass(frozen=True)
class _Usage:
    client_cores: float
    client_us: float
    """Client CPU per request completed in the measured windows, microseconds."""
    server_us: float
    """The same for the server's process tree; NaN without ``server_pid``."""


async def _measure(
    recorder: _Recorder, cfg: MeasureConfig, extra: Callable[[], bool] = lambda: False
) -> tuple[list[WindowStats], list[tuple[int, int, float]], _Usage]:
    """Warm up, then cut windows until stable; returns windows, their bounds and the CPU
    the client (and the server's tree, with ``server_pid``) used per request."""
    await asyncio.sleep(cfg.warmup_s)
    windows: list[WindowStats] = []
    bounds: list[tuple[int, int, float]] = []
    server = TreeCpu(cfg.server_pid) if cfg.server_pid is not None else None
    first = len(recorder.latencies)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    while len(windows) < cfg.max_windows:
        i0, t0 = len(recorder.latencies), time.perf_counter()
        await asyncio.sleep(cfg.window_s)
        i1, t1 = len(recorder.latencies), time.perf_counter()
        windows.append(recorder.window(i0, i1, t1 - t0, cfg.rows_per_request))
        bounds.append((i0, i1, t1 - t0))
        if is_stable(windows, cfg.stability, cfg.stable_windows):
            break
    client_s = time.process_time() - cpu_start
    server_s = server.lap() if server is not None else float("nan")
    requests = max(len(recorder.latencies) - first, 1)
    usage = _Usage(
        client_s / max(time.perf_counter() - wall_start, 1e-9),
        client_s / requests * 1e6,
        server_s / requests * 1e6,
    )
    return windows, bounds, usage


def _merge(
    recorder: _Recorder, bounds: list[tuple[int, int, float]], n: int, rows: int
) -> WindowStats:
    used = bounds[-n:]
    return recorder.window(used[0][0], used[-1][1], sum(b[2] for b in used), rows)


async def _check_first(target: Target) -> None:
    """One request before measuring, so a refused connection or unknown model fails at once."""
    check = getattr(target, "check", None)
    if check is not None:
        await asyncio.wait_for(check(), timeout=60)


async def closed_loop(target: Target, concurrency: int, cfg: MeasureConfig) -> Point:
    """``concurrency`` workers, each sending its next request when the last one returns."""
    await _check_first(target)
    recorder = _Recorder()
    stop = False

    timeout_s = None if cfg.timeout_ms is None else cfg.timeout_ms / 1e3

    async def worker() -> None:
        while not stop:  # a request given up is left behind: the next one starts at once
            t0 = time.perf_counter()
            outcome = await request(target, timeout_s, cfg.retries, t0)
            recorder.add(time.perf_counter() - t0, outcome)

    workers = [asyncio.create_task(worker()) for _ in range(int(concurrency))]
    try:
        windows, bounds, usage = await _measure(recorder, cfg)
    finally:
        stop = True
        await asyncio.gather(*workers, return_exceptions=True)
    cpu = usage.client_cores
    n = min(cfg.stable_windows, len(windows))
    stats = _merge(recorder, bounds, n, cfg.rows_per_request)
    # The generator's event loop is one thread: near a full core, it is the bottleneck.
    client_bound = getattr(target, "remote", False) and cpu > CLIENT_BOUND_CORES
    return Point(
        "concurrency",
        concurrency,
        stats,
        len(windows),
        is_stable(windows, cfg.stability, cfg.stable_windows),
        cpu,
        client_bound,
        stats.throughput,
        tuple(recorder.errors),
        usage.client_us,
        usage.server_us,
        cfg.timeout_ms,
        cfg.retries,
    )


async def open_loop(target: Target, rate: float, cfg: MeasureConfig, seed: int = 0) -> Point:
    """Requests due at Poisson arrivals of ``rate`` per second, whatever the responses do."""
    await _check_first(target)
    recorder = _Recorder()
    rng = random.Random(seed)
    in_flight: set[asyncio.Task] = set()
    saturated = 0
    sent = 0
    stop = False
    timeout_s = None if cfg.timeout_ms is None else cfg.timeout_ms / 1e3

    async def one(due: float) -> None:
        outcome = await request(target, timeout_s, cfg.retries, due)
        recorder.add(time.perf_counter() - due, outcome)

    async def schedule() -> None:
        nonlocal saturated, sent
        due = time.perf_counter()
        while not stop:
            due += rng.expovariate(rate)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= cfg.max_in_flight:
                saturated += 1
                continue
            task = asyncio.create_task(one(due))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            sent += 1

    scheduler = asyncio.create_task(schedule())
    start = time.perf_counter()
    try:
        windows, bounds, usage = await _measure(recorder, cfg)
    finally:
        stop = True
        await scheduler
        await asyncio.gather(*in_flight, return_exceptions=True)
    achieved = sent / (time.perf_counter() - start)
    cpu = usage.client_cores
    n = min(cfg.stable_windows, len(windows))
    stats = _merge(recorder, bounds, n, cfg.rows_per_request)
    behind = achieved < 0.95 * rate or saturated > 0
    behind = behind or (getattr(target, "remote", False) and cpu > CLIENT_BOUND_CORES)
    return Point(
        "rate",
        rate,
        stats,
        len(windows),
        is_stable(windows, cfg.stability, cfg.stable_windows),
        cpu,
        behind,
        achieved,
        tuple(recorder.errors),
        usage.client_us,
        usage.server_us,
        cfg.timeout_ms,
        cfg.retries,
    )


async def sweep(
    target: Target,
    levels: Sequence[float],
    mode: str,
    cfg: MeasureConfig,
    on_point: Callable[[Point], None] | None = None,
) -> list[Point]:
    """Measure each level in turn (``mode`` ``concurrency`` or ``rate``)."""
    if mode not in ("concurrency", "rate"):
        raise ValueError(f"mode must be 'concurrency' or 'rate', got {mode!r}")
    points = []
    for level in levels:
        if mode == "concurrency":
            if level != int(level) or level < 1:
                raise ValueError(f"concurrency must be a positive integer, got {level}")
            point = await closed_loop(target, int(level), cfg)
        else:
            point = await open_loop(target, float(level), cfg)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points
