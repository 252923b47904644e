"""Triton-named Prometheus metrics from servekit's own runtimes: exact counts after known traffic."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn (http extra)")

from conftest import parse_metrics, sample, scrape, serving
from servekit import (
    Batcher,
    BatchingPolicy,
    FunctionRunner,
    InvalidInput,
    ModelSpec,
    RunnerError,
    TensorSpec,
)
from servekit.http import KServeApp
from servekit.metrics import COUNTERS, GAUGES, SUMMARIES, Metrics

SPEC = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [2]),), 8)


def slow_or_failing(d):
    time.sleep(0.005)
    if (d["x"] < 0).any():
        raise ValueError("negative input")
    return {"y": d["x"] * 2}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_counts_match_the_traffic_exactly_and_durations_are_plausible():
    clock = Clock()
    metrics = Metrics(window_s=60, clock=clock, gpu=False)
    batcher = Batcher(FunctionRunner(slow_or_failing, SPEC), BatchingPolicy(max_batch_size=4))
    metrics.watch(batcher, "double", "3")

    async def main():
        for i in range(5):  # one at a time: one execution each
            await batcher.infer({"x": np.full((2, 2), i, np.float32)})
        with pytest.raises(RunnerError):
            await batcher.infer({"x": -np.ones((1, 2), np.float32)})
        with pytest.raises(InvalidInput):
            await batcher.infer({"x": np.ones((1, 3), np.float32)})
        await batcher.aclose()

    asyncio.run(main())
    got = parse_metrics(metrics.render())
    labels = {"model": "double", "version": "3"}

    def value(name: str, **extra: str) -> float:
        return sample(got, name, **labels, **extra)

    assert value("nv_inference_request_success") == 5
    assert value("nv_inference_request_failure") == 2  # the runner error and the bad shape
    assert value("nv_inference_count") == 11  # 5 x 2 rows + 1 failed row
    assert value("nv_inference_exec_count") == 6
    assert value("nv_inference_pending_request_count") == 0
    compute_us = value("nv_inference_compute_infer_duration_us")
    assert 6 * 5000 <= compute_us < 6 * 1_000_000
    assert value("nv_inference_request_duration_us") >= compute_us
    assert value("nv_inference_compute_infer_summary_us_count") == 6
    assert value("nv_inference_request_summary_us_count") == 6
    p50 = value("nv_inference_compute_infer_summary_us", quantile="0.5")
    p99 = value("nv_inference_compute_infer_summary_us", quantile="0.99")
    assert 5000 <= p50 <= p99 < 1_000_000
    # Quantiles look back over the window only; counts and sums stay cumulative.
    clock.now += 61
    later = parse_metrics(metrics.render())
    assert math.isnan(sample(later, "nv_inference_request_summary_us", **labels, quantile="0.5"))
    assert sample(later, "nv_inference_request_summary_us_count", **labels) == 6


def test_every_family_is_exported_with_help_and_type():
    metrics = Metrics(gpu=False)
    metrics.watch(Batcher(FunctionRunner(slow_or_failing, SPEC)), "m")
    text = metrics.render()
    for name in (*COUNTERS, *GAUGES, *SUMMARIES):
        assert f"# TYPE {name} " in text and f"# HELP {name} " in text
    with pytest.raises(ValueError, match="already watched"):
        metrics.watch(Batcher(FunctionRunner(slow_or_failing, SPEC)), "m")


def test_gpu_gauges_only_where_a_gpu_is():
    from servekit.metrics import _Nvml

    nvml = _Nvml()
    text = Metrics().render()
    if nvml.available:
        assert "nv_gpu_utilization{" in text and "nv_gpu_memory_used_bytes{" in text
    else:
        assert "nv_gpu_" not in text


@pytest.fixture
def front():
    batcher = Batcher(
        FunctionRunner(slow_or_failing, SPEC), BatchingPolicy(max_batch_size=4), name="double"
    )
    app = KServeApp({"double": batcher, "plain": FunctionRunner(lambda d: {"y": d["x"]}, SPEC)})
    try:
        with serving(app) as url:
            yield url
    finally:
        batcher.close()


def test_the_http_front_serves_metrics_for_its_batchers(front):
    import urllib.error
    import urllib.request

    from servekit.client import Client

    with Client(front) as c:
        for i in range(4):
            c.infer("double", {"x": np.full((1, 2), i, np.float32)})
        with pytest.raises(RunnerError):
            c.infer("double", {"x": -np.ones((1, 2), np.float32)})
        with pytest.raises(InvalidInput):
            c.infer("double", {"x": np.ones((1, 2), np.float64)})
    bad = urllib.request.Request(f"{front}/v2/models/double/infer", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad, timeout=10)
    assert err.value.code == 400
    err.value.close()
    got = scrape(f"{front}/metrics")
    labels = {"model": "double", "version": "1"}
    assert sample(got, "nv_inference_request_success", **labels) == 4
    assert sample(got, "nv_inference_request_failure", **labels) == 3
    assert sample(got, "nv_inference_exec_count", **labels) == 5
    assert sample(got, "nv_inference_count", **labels) == 5
    assert not any(dict(k[1]).get("model") == "plain" for k in got), "a Runner has no batcher"


def test_a_model_is_ready_only_while_its_server_is_and_its_queue_is_open():
    from conftest import parse_metrics

    metrics = Metrics(gpu=False)
    batcher = Batcher(FunctionRunner(slow_or_failing, SPEC))
    metrics.watch(batcher, "m")
    server = [True]
    metrics.ready = lambda: server[0]
    labels = frozenset({"model": "m", "version": "1"}.items())

    def ready() -> float:
        return parse_metrics(metrics.render())[("servekit_model_ready", labels)]

    assert ready() == 1
    server[0] = False
    assert ready() == 0
    server[0] = True
    asyncio.run(batcher.aclose())
    assert ready() == 0
