"""``servekit compare``: every runtime in turn, same model, same policy, same load, one report.

Each runtime is a context manager that starts it on loopback and yields a factory of
load-generator targets (made inside the measuring event loop) for the image model (JPEG in,
top-5 out): the in-process Pipeline, servekit's Batcher in front of it, and every runtime
of ``servekit serve`` built from one ``ServeConfig``. Runtimes that cannot run here are
skipped and named with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..batching import Batcher
from ..config import ModelConfig, RayOptions, ServeConfig, ServerConfig, image_model_name
from ..endpoints import PortRange
from ..stages import synthetic_image
from .loadgen import MeasureConfig, Point, sweep
from .report import markdown_head
from .stats import rows_per_s
from .targets import BatcherTarget, RunnerTarget, open_target

__all__ = [
    "PROTOCOLS",
    "RUNTIMES",
    "ComparisonResult",
    "ServerProcess",
    "Setup",
    "compare",
    "markdown_report",
    "spawned",
    "target_url",
]


@dataclass(frozen=True)
class Setup:
    model: ModelConfig
    """The model (file, policy, instances, threads) every runtime serves."""
    target: str
    """The served model the load goes to: ``<name>_image`` for an image classifier."""
    payload: dict[str, np.ndarray]
    image: bool
    protocol: str = "grpc"
    """How the served runtimes are reached: ``grpc``, ``http-binary`` or ``http-json``
    (Ray has HTTP only: binary when gRPC is asked for)."""
    ports: PortRange | None = None
    """Where every served runtime's ports are chosen (None: anywhere in 20000-32767)."""

    @classmethod
    def of(cls, model: ModelConfig) -> Setup:
        """An image classifier gets one 320x240 JPEG per request, your own code one row of
        its signature's sample inputs (BYTES: ``b"x"``, not an image), any other model one
        row of random tensors (``payload_from_metadata``)."""
        from ..protocol.kserve import metadata
        from ..runtime.base import probe_model
        from .payload import payload_from_metadata

        probe = probe_model(model)
        if probe.image_spec is not None:
            payload = {"image": np.array([[synthetic_image(0)]], dtype=object)}
            return cls(model, image_model_name(model.name), payload, True)
        if model.is_code:
            return cls(model, model.name, probe.spec.sample_inputs(1), False)
        inputs = metadata(model.name, probe.spec)["inputs"]
        return cls(model, model.name, payload_from_metadata(inputs), False)

    def local(self, threads: int | None = None) -> Any:
        """What the in-process rows call: the Pipeline (classifier) or the runner itself."""
        import dataclasses

        from ..pipeline import image_classifier
        from ..runtime.base import load_model_runner

        runner = load_model_runner(dataclasses.replace(self.model, threads=threads))
        return image_classifier(runner, top_k=self.model.top_k) if self.image else runner


@contextlib.contextmanager
def _raw(setup: Setup) -> Iterator[Any]:
    local = setup.local()
    try:
        yield (lambda: RunnerTarget(local, setup.payload, threads=16, name="raw")), None
    finally:
        local.close()


@contextlib.contextmanager
def _batcher(setup: Setup) -> Iterator[Any]:
    m = setup.model
    local = setup.local(m.threads)
    batcher = Batcher(local, m.batching, instance_count=m.instances, name=setup.target)
    try:
        yield (lambda: BatcherTarget(batcher, setup.payload)), None
    finally:
        batcher.close()
        local.close()


def _served(runtime: str, ray: RayOptions | None = None) -> Callable[[Setup], Any]:
    """``servekit serve --runtime RUNTIME`` in its own process, from the same ``ServeConfig``
    on loopback, so its process tree's CPU is its own; the targets speak gRPC where the
    runtime has it, HTTP otherwise. On Ray, half a CPU per model replica (``ray``)."""
    if ray is None:
        ray = RayOptions(model_cpus=0.5) if runtime == "ray" else RayOptions()

    @contextlib.contextmanager
    def served(setup: Setup) -> Iterator[Any]:
        config = ServeConfig(
            (setup.model,), ServerConfig(exit_timeout_s=2), runtime=runtime, ray=ray
        ).on_loopback(setup.ports)
        url = target_url(config, setup.protocol)
        binary = setup.protocol != "http-json"
        with ServerProcess(config) as server:
            server.wait_ready([setup.target])
            yield (lambda: open_target(url, setup.target, setup.payload, binary=binary)), server.pid

    return served


PROTOCOLS = ("grpc", "http-binary", "http-json")


def target_url(config: ServeConfig, protocol: str = "grpc") -> str:
    """Where the load goes: the runtime's gRPC port (HTTP for Ray, its only one) or its
    HTTP port."""
    if protocol == "grpc" and config.runtime != "ray":
        return config.server.grpc_url
    return config.server.http_url


@contextlib.contextmanager
def spawned(
    argv: Sequence[str], ready: Callable[[], bool], what: str, timeout_s: float = 180.0
) -> Iterator[int]:
    """A peer server (a plain Ray app, say) in a process of its own: its pid once ``ready()``
    is true; terminated (killed if it lingers) on the way out."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(Exception):
                if ready():
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.5)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


class ServerProcess:
    """``servekit serve --config`` in a process of its own: start, wait, stop (SIGTERM)."""

    def __init__(self, config: ServeConfig, *extra_args: str) -> None:
        self.config, self.extra_args = config, extra_args
        self._dir = tempfile.TemporaryDirectory(prefix="servekit-server-")
        self.log = Path(self._dir.name) / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> ServerProcess:
        path = Path(self._dir.name) / "serve.toml"
        path.write_text(self.config.to_toml())
        command = [sys.executable, "-m", "servekit", "serve", "--config", str(path)]
        with self.log.open("wb") as log:
            # A session of its own: a runtime that signals its process group on the way out
            # (Ray's node shutdown) must not take the measuring process with it.
            self.proc = subprocess.Popen(
                [*command, *self.extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, models: Sequence[str], timeout_s: float = 300.0) -> None:
        from ..client import Client

        deadline = time.monotonic() + timeout_s
        url = self.config.server.http_url
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-3000:]}")
            try:
                with Client(url) as client:
                    if client.is_ready() and all(client.is_ready(m) for m in models):
                        return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{models} not ready in {timeout_s} s: {self.log.read_text()[-3000:]}"
                )
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


def pipeline_ceiling(setup: Setup, seconds: float = 5.0) -> tuple[float, dict[int, float]]:
    """The in-process model's best rows/s over batch sizes 1, 8, 16 (those the model
    takes) and its max batch size (no server at all):
    the Pipeline for a classifier, the runner otherwise."""
    local = setup.local()
    by_batch: dict[int, float] = {}
    try:
        most = max(local.spec.max_batch_size, 1)
        for batch in sorted({b for b in (1, 8, 16) if b <= most} | {most}):
            rows = {k: np.concatenate([v] * batch) for k, v in setup.payload.items()}
            by_batch[batch] = rows_per_s(lambda: local.infer(rows), batch, seconds)  # noqa: B023 - called before the loop moves on
    finally:
        local.close()
    return max(by_batch.values()), by_batch


class _Skip(Exception):
    """A runtime that cannot run here, with the reason."""


def _needs(module: str, extra: str) -> Callable[[Callable[[Setup], Any]], Callable[[Setup], Any]]:
    def wrap(factory: Callable[[Setup], Any]) -> Callable[[Setup], Any]:
        def checked(setup: Setup) -> Any:
            try:
                __import__(module)
            except ImportError:
                raise _Skip(
                    f"{module} is not installed (pip install 'servekit[{extra}]')"
                ) from None
            return factory(setup)

        return checked

    return wrap


RUNTIMES: dict[str, Callable[[Setup], Any]] = {
    "raw": _raw,
    "batcher": _batcher,
    "native": _needs("uvicorn", "http")(_served("native")),
    "pytriton": _needs("pytriton", "triton")(_served("pytriton")),
    "triton": _needs("pytriton", "triton")(_served("triton")),
    "ray": _needs("ray", "ray")(_served("ray")),
    "ray-direct": _needs("ray", "ray")(_served("ray", RayOptions(model_cpus=0.5, direct=True))),
    "ray-direct-fused": _needs("ray", "ray")(
        _served("ray", RayOptions(model_cpus=1.0, direct=True, fuse=True))
    ),
}
"""Runtime name -> context manager yielding a target factory. ``raw`` is the in-process
Pipeline called one image per request from concurrent threads (no batching, no server);
``batcher`` servekit's Batcher in front of it, in-process; the others are ``servekit serve
--runtime NAME`` (``triton``: the repository's ensemble on the servekit backend;
``ray-direct``: Ray with ``[ray] direct``; ``ray-direct-fused``: with ``fuse`` too, the
models in the ingress replica)."""


@dataclass
class ComparisonResult:
    series: dict[str, list[Point]]
    skipped: dict[str, str]
    ceiling: float | None = None
    """The in-process Pipeline's best images/s at its best batch size: the raw ceiling."""
    ceiling_by_batch: dict[int, float] | None = None
    workload: str = ""
    """What each request is, in words (for the report)."""

    def share_of_raw(self) -> dict[str, float]:
        """Each runtime's best inferences/s as a fraction of the raw ceiling (or raw's best)."""
        if self.ceiling:
            raw = self.ceiling
        elif "raw" in self.series:
            raw = max(p.stats.inferences_per_s for p in self.series["raw"])
        else:
            return {}
        return {
            name: max(p.stats.inferences_per_s for p in pts) / raw
            for name, pts in self.series.items()
        }


def compare(
    model: ModelConfig,
    runtimes: Sequence[str],
    levels: Sequence[float],
    cfg: MeasureConfig,
    *,
    on_event: Callable[[str], None] = lambda _: None,
    ceiling_seconds: float = 0.0,
    protocol: str = "grpc",
    ports: PortRange | None = None,
) -> ComparisonResult:
    """Run the same closed-loop sweep against each runtime in turn, each serving ``model``
    (an image classifier: its image model takes the load); with ``ceiling_seconds``, first
    measure the in-process Pipeline's best batched throughput as the raw ceiling. Every
    port a served runtime opens is chosen ``ports`` (a range), where one is given."""
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ValueError(f"unknown runtime(s) {unknown}; choose from {list(RUNTIMES)}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {list(PROTOCOLS)}")
    setup = dataclasses.replace(Setup.of(model), protocol=protocol, ports=ports)
    result = ComparisonResult({}, {}, workload=_workload(setup))
    if ceiling_seconds > 0:
        on_event("measuring the raw ceiling (in-process, batch 1/8/16/max)")
        result.ceiling, result.ceiling_by_batch = pipeline_ceiling(setup, ceiling_seconds)
    for name in runtimes:
        try:
            context = RUNTIMES[name](setup)
        except _Skip as exc:
            result.skipped[name] = str(exc)
            on_event(f"skipped {name}: {exc}")
            continue
        on_event(f"measuring {name}")
        with context as (make_target, pid):
            measure = dataclasses.replace(cfg, server_pid=pid)

            async def run(make_target: Any = make_target, measure: Any = measure) -> list[Point]:
                target = make_target()  # inside the loop: asyncio clients bind to it
                try:
                    return await sweep(target, levels, "concurrency", measure)
                finally:
                    await target.close()

            result.series[name] = asyncio.run(run())
    return result


def _workload(setup: Setup) -> str:
    over = {
        "grpc": "Served runtimes are reached over gRPC (Ray over HTTP with binary tensors, its only port).",
        "http-binary": "Served runtimes are reached over HTTP with binary tensors.",
        "http-json": "Served runtimes are reached over HTTP with JSON tensors.",
    }[setup.protocol]
    return f"{_what(setup)} {over}"


def _what(setup: Setup) -> str:
    if setup.image:
        return (
            f"Every runtime classifies the same 320x240 JPEG (decode, resize, crop, normalise, "
            f"{setup.model.name}, top-{setup.model.top_k}) on `{setup.target}`, closed loop, one "
            "image per request, same policy."
        )
    shapes = ", ".join(f"{k} {v.dtype} {list(v.shape)}" for k, v in setup.payload.items())
    return (
        f"Every runtime serves `{setup.target}` with the same policy, closed loop, one request "
        f"of {shapes} at a time per client."
    )


def markdown_report(result: ComparisonResult, command: str, plot: str | None, machine: str) -> str:
    """The comparison as Markdown: the command, the table, shares of raw, skipped runtimes."""
    shares = result.share_of_raw()
    lines = [
        *markdown_head("servekit compare", machine, command),
        result.workload
        or "Every runtime serves the same model, closed loop, one request at a time per client.",
        "",
        (
            f"Raw ceiling: {result.ceiling:.1f} rows/s, the in-process model at its best batch size "
            f"(by batch: {', '.join(f'{b}: {v:.1f}' for b, v in (result.ceiling_by_batch or {}).items())}). "
            "The `raw` rows call it one request at a time from concurrent threads."
            if result.ceiling
            else "Shares are of the `raw` rows' best."
        ),
        "",
        "| runtime | concurrency | rows/s | share of raw (best) | p50 ms | p95 ms | p99 ms | errors "
        "| server CPU us/request | client CPU us/request |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, points in result.series.items():
        for p in points:
            s = p.stats
            server = "-" if math.isnan(p.server_cpu_us) else f"{p.server_cpu_us:.0f}"
            lines.append(
                f"| {name} | {p.level:g} | {s.inferences_per_s:.1f} | {shares.get(name, float('nan')):.1%} | "
                f"{s.p50_ms:.1f} | {s.p95_ms:.1f} | {s.p99_ms:.1f} | {s.errors} | {server} | "
                f"{p.client_cpu_us:.0f} |"
            )
    if shares:
        lines += [
            "",
            "Best throughput as a share of raw: "
            + ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
            + ".",
        ]
    if result.skipped:
        lines += [
            "",
            "Skipped: " + "; ".join(f"{k} ({v})" for k, v in result.skipped.items()) + ".",
        ]
    if plot:
        lines += ["", f"![latency against throughput]({plot})"]
    return "\n".join(lines) + "\n"
