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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..batching import Batcher
from ..config import ModelConfig, RayOptions, ServeConfig, ServerConfig, image_model_name
from ..stages import synthetic_image
from .loadgen import MeasureConfig, Point, sweep
from .stats import rows_per_s
from .targets import BatcherTarget, RunnerTarget, open_target

__all__ = ["RUNTIMES", "ComparisonResult", "compare", "markdown_report"]


@dataclass(frozen=True)
class Setup:
    model: ModelConfig
    """The model (file, policy, instances, threads) every runtime serves."""
    payload: dict[str, np.ndarray]


@contextlib.contextmanager
def _raw(setup: Setup) -> Iterator[Any]:
    from ..pipeline import image_classifier
    from ..runners.onnx import OnnxRuntimeRunner

    clf = image_classifier(OnnxRuntimeRunner(setup.model.source))
    try:
        yield lambda: RunnerTarget(clf, setup.payload, threads=16, name="raw")
    finally:
        clf.close()


@contextlib.contextmanager
def _batcher(setup: Setup) -> Iterator[Any]:
    from ..pipeline import image_classifier
    from ..runtime.base import load_model_runner

    m = setup.model
    clf = image_classifier(load_model_runner(m))
    batcher = Batcher(clf, m.batching, instance_count=m.instances, name=image_model_name(m.name))
    try:
        yield lambda: BatcherTarget(batcher, setup.payload)
    finally:
        batcher.close()
        clf.close()


def _served(runtime: str) -> Callable[[Setup], Any]:
    """A runtime started by ``create_runtime`` from the same ``ServeConfig`` on loopback;
    the targets speak gRPC where the runtime has it, HTTP otherwise."""

    @contextlib.contextmanager
    def served(setup: Setup) -> Iterator[Any]:
        from ..runtime import create_runtime

        config = ServeConfig(
            (setup.model,),
            ServerConfig(exit_timeout_s=2),
            runtime=runtime,
            ray=RayOptions(model_cpus=0.5) if runtime == "ray" else RayOptions(),
        ).on_loopback()
        server = create_runtime(config)
        server.start()
        try:
            url = config.server.http_url if runtime in ("ray", "native") else config.server.grpc_url
            image = image_model_name(setup.model.name)
            yield lambda: open_target(url, image, setup.payload)
        finally:
            server.stop()

    return served


def pipeline_ceiling(model_path: Path, seconds: float = 5.0) -> tuple[float, dict[int, float]]:
    """The in-process Pipeline's best images/s over batch sizes 1, 8 and 16 (no server at all)."""
    from ..pipeline import image_classifier
    from ..runners.onnx import OnnxRuntimeRunner

    jpeg = synthetic_image(0)
    by_batch: dict[int, float] = {}
    clf = image_classifier(OnnxRuntimeRunner(model_path))
    try:
        for batch in (1, 8, 16):
            images = [jpeg] * batch
            by_batch[batch] = rows_per_s(lambda: clf.classify(images), batch, seconds)  # noqa: B023 - called before the loop moves on
    finally:
        clf.close()
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
}
"""Runtime name -> context manager yielding a target factory. ``raw`` is the in-process
Pipeline called one image per request from concurrent threads (no batching, no server);
``batcher`` servekit's Batcher in front of it, in-process; the others are ``servekit serve
--runtime NAME`` (``triton``: the repository's ensemble on the servekit backend)."""


@dataclass
class ComparisonResult:
    series: dict[str, list[Point]]
    skipped: dict[str, str]
    ceiling: float | None = None
    """The in-process Pipeline's best images/s at its best batch size: the raw ceiling."""
    ceiling_by_batch: dict[int, float] | None = None

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
) -> ComparisonResult:
    """Run the same closed-loop sweep against each runtime in turn, each serving ``model``
    (an image classifier: its image model takes the load); with ``ceiling_seconds``, first
    measure the in-process Pipeline's best batched throughput as the raw ceiling."""
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ValueError(f"unknown runtime(s) {unknown}; choose from {list(RUNTIMES)}")
    payload = {"image": np.array([[synthetic_image(0)]], dtype=object)}
    setup = Setup(model, payload)
    model_path = Path(model.source)
    result = ComparisonResult({}, {})
    if ceiling_seconds > 0:
        on_event("measuring the raw ceiling (in-process Pipeline, batch 1/8/16)")
        result.ceiling, result.ceiling_by_batch = pipeline_ceiling(
            Path(model_path), ceiling_seconds
        )
    for name in runtimes:
        try:
            context = RUNTIMES[name](setup)
        except _Skip as exc:
            result.skipped[name] = str(exc)
            on_event(f"skipped {name}: {exc}")
            continue
        on_event(f"measuring {name}")
        with context as make_target:

            async def run(make_target: Any = make_target) -> list[Point]:
                target = make_target()  # inside the loop: asyncio clients bind to it
                try:
                    return await sweep(target, levels, "concurrency", cfg)
                finally:
                    await target.close()

            result.series[name] = asyncio.run(run())
    return result


def markdown_report(result: ComparisonResult, command: str, plot: str | None, machine: str) -> str:
    """The comparison as Markdown: the command, the table, shares of raw, skipped runtimes."""
    shares = result.share_of_raw()
    lines = [
        "# servekit compare",
        "",
        f"Machine: {machine}.",
        "",
        "```sh",
        command,
        "```",
        "",
        "Every runtime classifies the same 320x240 JPEG (decode, resize, crop, normalise, "
        "ResNet-50, top-5), closed loop, one image per request, same policy.",
        "",
        (
            f"Raw ceiling: {result.ceiling:.1f} images/s, the in-process Pipeline at its best batch size "
            f"(by batch: {', '.join(f'{b}: {v:.1f}' for b, v in (result.ceiling_by_batch or {}).items())}). "
            "The `raw` rows call the same Pipeline one image per request from concurrent threads."
            if result.ceiling
            else "Shares are of the `raw` rows' best."
        ),
        "",
        "| runtime | concurrency | images/s | share of raw (best) | p50 ms | p95 ms | p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, points in result.series.items():
        for p in points:
            s = p.stats
            lines.append(
                f"| {name} | {p.level:g} | {s.inferences_per_s:.1f} | {shares.get(name, float('nan')):.1%} | "
                f"{s.p50_ms:.1f} | {s.p95_ms:.1f} | {s.p99_ms:.1f} | {s.errors} |"
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
