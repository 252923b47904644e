"""The failure counter Triton's Python backend lacks, for servekit code running in its stub.

Triton 2.51 counts a request in ``nv_inference_request_failure`` only when a Python model's
``execute`` raises; a request answered with an error response (a bad image in a batch of
good ones, say) is counted as a success. The servekit backend and the PyTriton error shim
answer per-request errors that way, so they also count them here, through the Python
backend's custom-metrics API, on Triton's own metrics endpoint:
``servekit_request_failure{model, version, code}``. servekit's own runtimes (Batcher, HTTP
front, Ray) count the same requests in ``nv_inference_request_failure`` and do not export
this family, so dashboards add the two without counting anything twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..metrics import (
    FAILURE_HELP,
    FAILURE_METRIC,
    ISOLATED_HELP,
    ISOLATED_METRIC,
    OVERLAP_HELP,
    OVERLAP_METRIC,
)

__all__ = ["FAILURE_METRIC", "OVERLAP_METRIC", "FailureCounter", "overlap_counter"]


class FailureCounter:
    """Counts error responses per Triton error code (a no-op where metrics are off)."""

    def __init__(self, pb_utils: Any, model: str, version: str) -> None:
        self._labels = {"model": model, "version": version}
        self._metrics: dict[str, Any] = {}
        try:
            self._family = pb_utils.MetricFamily(
                name=FAILURE_METRIC,
                description=FAILURE_HELP,
                kind=pb_utils.MetricFamily.COUNTER,
            )
        except Exception:  # metrics disabled in this tritonserver
            self._family = None

        self._isolated: Any = None
        try:
            self._isolated_family = pb_utils.MetricFamily(
                name=ISOLATED_METRIC, description=ISOLATED_HELP,
                kind=pb_utils.MetricFamily.COUNTER,
            )  # fmt: skip
            self._isolated = self._isolated_family.Metric(labels=self._labels)
        except Exception:
            self._isolated = None

    def count(self, code: str, isolated: bool = False) -> None:
        """One error response (``isolated``: the rest of its batch was answered)."""
        if self._family is None:
            return
        metric = self._metrics.get(code)
        if metric is None:
            metric = self._family.Metric(labels={**self._labels, "code": code})
            self._metrics[code] = metric
        metric.increment(1)
        if isolated and self._isolated is not None:
            self._isolated.increment(1)


class _Counted:
    """One labelled counter, holding its family: Triton refuses a metric whose family is gone."""

    def __init__(self, family: Any, labels: dict[str, str]) -> None:
        self._family, self._metric = family, family.Metric(labels=labels)

    def __call__(self) -> None:
        self._metric.increment(1)


def overlap_counter(pb_utils: Any, model: str, version: str) -> Callable[[], None]:
    """``servekit_batch_overlapped{model, version}``: counts a batch handed over while the
    instance's previous one ran (``servekit.triton.pipeline``); a no-op where metrics are
    off."""
    try:
        family = pb_utils.MetricFamily(
            name=OVERLAP_METRIC, description=OVERLAP_HELP, kind=pb_utils.MetricFamily.COUNTER
        )
        return _Counted(family, {"model": model, "version": version})
    except Exception:  # metrics disabled in this tritonserver
        return lambda: None
