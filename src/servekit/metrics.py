"""Prometheus metrics with Triton's names and labels, for the runtimes Triton does not run.

Triton (and so PyTriton and the servekit backend) exports ``nv_inference_*`` itself on its
metrics port. servekit's Batcher, its KServe v2 front and the Ray app export the same
names, labels (``model``, ``version``) and meanings, so one dashboard and one autoscaling
rule serve every runtime. Counts are read from each Batcher's ``stats`` at scrape time.
Latency summaries (``*_summary_us`` with quantiles, as Triton's
``--metrics-config summary_latencies=true``) come from a sliding window of per-request
observations fed by the Batcher's batch listener; durations add up per request, as
Triton's do (a batch of four adds its compute time four times). GPU gauges come from
NVML (``nvidia-ml-py``) where a GPU exists and are left out cleanly where none does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import storage
from .autoscale import AutoscalePolicy, Counters, Demand
from .batching import Batcher, BatchRecord
from .batching.sequencer import SequenceBatcher
from .rollout import Traffic
from .window import SlidingWindow, percentiles

Family = tuple[str, str, str, list[tuple[dict[str, str], float]]]
"""A metric family from elsewhere (``Metrics.collect``): name, kind, help, (labels, value)s."""

__all__ = [
    "CONTENT_TYPE",
    "COUNTERS",
    "DEMAND",
    "GAUGES",
    "QUANTILES",
    "READY",
    "SUMMARIES",
    "Metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed",
    "nv_inference_exec_count": "Number of model executions performed",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds",
}
FAILURE_METRIC = "servekit_request_failure"
FAILURE_HELP = "Requests a servekit model answered with an error response"
FITTED_METRIC = "servekit_fitted_batch_rows"
FITTED_HELP = (
    "The most rows a batch holds since the device ran out of memory on a larger one "
    "(larger batches run in parts); absent until it has"
)
PINNED_METRIC = "servekit_staging_pinned_bytes"
PINNED_HELP = "Page-locked host bytes the model's staging holds (a model on a GPU)"
ISOLATED_METRIC = "servekit_request_isolated"
ISOLATED_HELP = (
    "Requests that failed alone while the rest of their batch was answered "
    "(servekit.batching.execute); each is in the failures too"
)
OVERLAP_METRIC = "servekit_batch_overlapped"
OVERLAP_HELP = (
    "Batches handed to a Triton instance while it still ran the one before (model overlap)"
)
"""The failures Triton's own counters miss: its Python backend's error responses (counted
in the stub, ``triton.stub_metrics``) and requests servekit's front refused before they
reached tritonserver (counted here)."""
ABANDONED_METRIC = "servekit_requests_abandoned_total"
ABANDONED_HELP = (
    "Requests whose client left (closed, reset, cancelled, past its deadline) before the "
    "answer: where=queued were dropped unrun, forwarded were cancelled on their way, "
    "running ran in a batch and their answers were dropped"
)
SHED_METRIC = "servekit_requests_shed_total"
SHED_HELP = (
    "Requests refused at once (503 / UNAVAILABLE, Retry-After) because the queue's measured "
    "pace would answer them after their deadline (shed_late)"
)
TIMED_OUT_METRIC = "servekit_requests_timed_out_total"
TIMED_OUT_HELP = (
    "Requests whose queue timeout (the model's, or the KServe timeout parameter its policy "
    "lets a request set) passed while they waited: failed with DeadlineExceeded, never run"
)
DEMAND = "servekit_replicas_needed"
READY = "servekit_model_ready"
GAUGES = {
    READY: "Whether the model takes requests now (1) or not (0): the server ready, the model "
    "loaded and its queue open",
    "nv_inference_pending_request_count": "Instantaneous number of pending requests awaiting execution per-model",
    DEMAND: "Replicas of this server the model's traffic over the autoscaling window needs "
    "(servekit.autoscale); summed over servers, the replicas to ask for",
}
BUDGET_GAUGES = {
    "servekit_latency_budget_seconds": (
        "budget_s",
        "The latency budget the batcher holds (latency_budget_ms): queue plus compute",
    ),
    "servekit_latency_budget_attainment": (
        "attainment",
        "Share of the recent requests answered within the latency budget",
    ),
    "servekit_batch_target_rows": (
        "target_rows",
        "The fewest rows the budget's batcher holds a batch for while another instance runs "
        "one (the fewest that keep up with the arrivals); an idle server sends at once, and a "
        "batch takes all that waits up to max_batch_size (servekit_batch_rows)",
    ),
    "servekit_batch_rows": (
        "batch_rows",
        "Mean rows of the last 64 batches the budget's batcher ran",
    ),
    "servekit_batch_delay_seconds": (
        "held_s",
        "How long the budget's batcher held the last batch's oldest request for more rows",
    ),
}
"""The latency budget's choices (``batching.budget``), for models that set one."""
SUMMARIES = {
    "nv_inference_request_summary_us": "Summary of inference request duration in microseconds",
    "nv_inference_queue_summary_us": "Summary of inference queuing duration in microseconds",
    "nv_inference_compute_infer_summary_us": "Summary of compute inference duration in microseconds",
}
GPU_GAUGES = {
    "nv_gpu_utilization": "GPU utilization rate [0.0 - 1.0)",
    "nv_gpu_memory_total_bytes": "GPU total memory, in bytes",
    "nv_gpu_memory_used_bytes": "GPU used memory, in bytes",
}
QUANTILES = (0.5, 0.9, 0.95, 0.99)


class _Window:
    """Per-request observations of one summary over the last ``window_s`` seconds."""

    def __init__(self, window_s: float) -> None:
        self.points: SlidingWindow[float] = SlidingWindow(window_s, maxlen=100_000)
        self.count = 0
        self.total = 0.0

    def add(self, now: float, values: Iterable[float]) -> None:
        for v in values:
            self.points.add(now, v)
            self.count += 1
            self.total += v

    def quantiles(self, now: float) -> list[float]:
        """Nearest rank, as every percentile servekit reports (``servekit.window``)."""
        return percentiles(self.points.items(now), [100 * q for q in QUANTILES])


@dataclass
class _Watched:
    batcher: Batcher | SequenceBatcher
    labels: str
    summaries: dict[str, _Window]
    demand: Demand
    model: str
    front_failures: int = 0
    compute_us: float = 0.0
    """Per request, as Triton counts it: each request adds its whole batch's compute time."""


class Metrics:
    """Triton-named metrics for Batchers; ``render()`` is the Prometheus text exposition.

    Args:
        window_s: how far back the summaries' quantiles look.
        gpu: export NVML GPU gauges when a GPU and ``nvidia-ml-py`` are present.
        clock: injectable for tests.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        *,
        gpu: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s, self._clock = window_s, clock
        self._models: dict[tuple[str, str], _Watched] = {}
        self._lock = threading.Lock()
        self._gpu = _Nvml() if gpu else None
        self._traffic: dict[str, Traffic] = {}
        # This process's downloads from object storage (none until one happens).
        self._sources: list[Callable[[], Iterable[Family]]] = [storage.figures]
        self._refused: dict[tuple[str, str], int] = {}
        self.ready: Callable[[], bool] = lambda: True
        """The server's readiness (its app sets it): a model is ready only while it is."""
        self.autoscale: dict[str, AutoscalePolicy] = {}
        """Model name -> its ``[models.autoscale]`` (the defaults for a model not named)."""

    def watch(self, batcher: Batcher | SequenceBatcher, model: str, version: str = "1") -> None:
        """Export ``batcher``'s traffic as model ``model``, version ``version``."""
        key = (model, version)
        if key in self._models:
            raise ValueError(f"model {model!r} version {version!r} is already watched")
        watched = _Watched(
            batcher,
            f'model="{_escape(model)}",version="{_escape(version)}"',
            {name: _Window(self.window_s) for name in SUMMARIES},
            Demand(
                batcher.policy.max_batch_size or 1,
                clock=self._clock,
                instances=getattr(batcher, "instance_count", 1),
                hold_us=batcher.policy.max_queue_delay_us,
            ),
            model,
        )
        self._models[key] = watched
        batcher.listeners.append(lambda record: self._observe(watched, record))
        stats = batcher.stats.snapshot()  # the signal's window starts here, not at a scrape
        watched.demand.observe(
            Counters(stats.request_success, stats.inference_count, stats.execution_count,
                     stats.queue_us, 0.0)
        )  # fmt: skip

    def unwatch(self, model: str, version: str = "1") -> None:
        """Stop exporting model ``model``'s Batcher (it was unloaded)."""
        with self._lock:
            self._models.pop((model, version), None)

    def collect(self, source: Callable[[], Iterable[Family]]) -> None:
        """Export the families ``source`` yields on every render (the model store's)."""
        self._sources.append(source)

    def failed(self, model: str, version: str = "1") -> None:
        """Count a request that failed before it reached the model's Batcher (a bad body, say)."""
        watched = self._models.get((model, version))
        with self._lock:
            if watched is not None:
                watched.front_failures += 1
            else:  # a front before tritonserver: counted where Triton's own are not
                key = (model, version)
                self._refused[key] = self._refused.get(key, 0) + 1

    @property
    def models(self) -> list[tuple[str, str]]:
        return list(self._models)

    def replicas_needed(self, model: str, version: str = "1") -> float:
        """The autoscaling signal of ``model``'s Batcher alone, as ``render`` exports it
        (what a Ray replica reports to Serve's autoscaler)."""
        with self._lock:
            watched = self._models[model, version]
            return self._needed(watched, watched.batcher.stats.snapshot())

    def _needed(self, w: _Watched, s: Any) -> float:
        w.demand.policy = self.autoscale.get(w.model, w.demand.policy)
        w.demand.hold_us = w.batcher.policy.max_queue_delay_us  # a reload may change it
        counters = Counters(
            s.request_success, s.inference_count, s.execution_count, s.queue_us, w.compute_us
        )
        needed = w.demand.observe(counters)
        budget = getattr(w.batcher, "budget", None)
        if budget is None:
            return needed
        # The batcher's own budget: the replicas the arrivals need with batches held to it.
        return budget.replicas_needed()

    def _observe(self, watched: _Watched, record: BatchRecord) -> None:
        now = self._clock()
        with self._lock:
            w = watched.summaries
            w["nv_inference_queue_summary_us"].add(now, record.queue_us)
            w["nv_inference_compute_infer_summary_us"].add(
                now, [record.compute_us] * record.requests
            )
            w["nv_inference_request_summary_us"].add(
                now, (q + record.compute_us for q in record.queue_us)
            )
            watched.compute_us += record.compute_us * record.requests

    def render(self) -> str:
        """The current values in Prometheus text format 0.0.4."""
        now = self._clock()
        lines: list[str] = []
        with self._lock:
            rows = [
                (w, w.batcher.stats.snapshot(), w.front_failures) for w in self._models.values()
            ]
            values: dict[str, list[tuple[str, float]]] = {n: [] for n in (*COUNTERS, *GAUGES)}
            server_ready = bool(rows) and self.ready()
            for w, s, front in rows:
                request_us = w.summaries["nv_inference_request_summary_us"].total
                for name, value in (
                    ("nv_inference_request_success", s.request_success),
                    (
                        "nv_inference_request_failure",
                        s.request_failure + s.request_invalid + front,
                    ),
                    ("nv_inference_count", s.inference_count),
                    ("nv_inference_exec_count", s.execution_count),
                    ("nv_inference_request_duration_us", request_us),
                    ("nv_inference_queue_duration_us", s.queue_us),
                    ("nv_inference_compute_infer_duration_us", w.compute_us),
                    ("nv_inference_pending_request_count", w.batcher.pending),
                    (READY, server_ready and not w.batcher.closed),
                ):
                    values[name].append((w.labels, float(value)))
                values[DEMAND].append((w.labels, self._needed(w, s)))
            for name, help_text in COUNTERS.items():
                _family(lines, name, "counter", help_text, values[name])
            abandoned = [
                (f'{w.labels},where="{where}"', float(n))
                for w, s, _ in rows
                for where, n in (("queued", s.abandoned_queued), ("running", s.abandoned_running))
            ]
            if abandoned:
                _family(lines, ABANDONED_METRIC, "counter", ABANDONED_HELP, abandoned)
            shed = [
                (w.labels, float(s.request_shed))
                for w, s, _ in rows
                if getattr(getattr(w.batcher, "policy", None), "shed_late", False)
            ]
            if shed:
                _family(lines, SHED_METRIC, "counter", SHED_HELP, shed)
            timed_out = [(w.labels, float(s.request_timeout)) for w, s, _ in rows]
            if timed_out:
                _family(lines, TIMED_OUT_METRIC, "counter", TIMED_OUT_HELP, timed_out)
            isolated = [(w.labels, float(s.request_isolated)) for w, s, _ in rows]
            if isolated:
                _family(lines, ISOLATED_METRIC, "counter", ISOLATED_HELP, isolated)
            for name, help_text, figure in (
                (FITTED_METRIC, FITTED_HELP, lambda b: b.fitted_rows),
                (PINNED_METRIC, PINNED_HELP, lambda b: b.pinned_bytes),
            ):  # a Batcher's, where it has one to say
                samples = [
                    (w.labels, float(figure(w.batcher)))
                    for w, _, _ in rows
                    if isinstance(w.batcher, Batcher) and figure(w.batcher)
                ]
                if samples:
                    _family(lines, name, "gauge", help_text, samples)
            for name, help_text in GAUGES.items():
                if name not in (DEMAND, READY) or values[name]:  # a front's: from tritonserver
                    _family(lines, name, "gauge", help_text, values[name])
            budgets = [
                (w.labels, budget.figures())
                for w, _, _ in rows
                if (budget := getattr(w.batcher, "budget", None)) is not None
            ]
            for name, (key, help_text) in BUDGET_GAUGES.items():
                samples = [(labels, f[key]) for labels, f in budgets if key in f]
                if samples:
                    _family(lines, name, "gauge", help_text, samples)
            for name, help_text in SUMMARIES.items():
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} summary")
                for w, _, _ in rows:
                    window = w.summaries[name]
                    for q, v in zip(QUANTILES, window.quantiles(now), strict=True):
                        lines.append(f'{name}{{{w.labels},quantile="{q}"}} {_num(v)}')
                    lines.append(f"{name}_count{{{w.labels}}} {window.count}")
                    lines.append(f"{name}_sum{{{w.labels}}} {_num(window.total)}")
            if self._refused:
                refused = [
                    (f'model="{_escape(m)}",version="{_escape(v)}",code="INVALID_ARG"', float(n))
                    for (m, v), n in sorted(self._refused.items())
                ]
                _family(lines, FAILURE_METRIC, "counter", FAILURE_HELP, refused)
        if self._traffic:
            self._render_rollout(lines)
        for source in self._sources:
            for family, kind, about, collected in source():
                labelled = [
                    (",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()), value)
                    for labels, value in collected
                ]
                _family(lines, family, kind, about, labelled)
        if self._gpu is not None:
            for name, (help_text, samples) in self._gpu.read().items():
                _family(lines, name, "gauge", help_text, samples)
        return "\n".join(lines) + "\n"

    def watch_traffic(self, traffic: Traffic) -> None:
        """Export a versioned model's split, per-version counts and canary verdicts."""
        with self._lock:
            self._traffic[traffic.name] = traffic

    def _render_rollout(self, lines: list[str]) -> None:
        values: dict[str, list[tuple[str, float]]] = {n: [] for n in ROLLOUT}
        for name, traffic in sorted(self._traffic.items()):
            state = traffic.state_dict()
            window = (state["canary"] or {}).get("window", {})
            for version, counts in state["counts"].items():
                labels = f'model="{_escape(name)}",version="{version}"'
                for metric, key in ROLLOUT_COUNTS.items():
                    values[metric].append((labels, float(counts[key])))
                values["servekit_traffic_share_percent"].append(
                    (labels, float(state["split"].get(version, 0)))
                )
                p99 = window.get(version, {}).get("p99_ms")
                if p99 is not None:
                    values["servekit_canary_window_p99_seconds"].append((labels, p99 / 1e3))
            for (version, verdict), count in sorted(traffic.verdicts.items()):
                labels = f'model="{_escape(name)}",version="{version}",verdict="{verdict}"'
                values["servekit_canary_verdicts_total"].append((labels, float(count)))
        for metric, (kind, help_text) in ROLLOUT.items():
            _family(lines, metric, kind, help_text, values[metric])


ROLLOUT_COUNTS = {
    "servekit_version_requests_total": "requests",
    "servekit_version_errors_total": "errors",
    "servekit_shadow_runs_total": "shadow_runs",
    "servekit_shadow_mismatches_total": "mismatches",
    "servekit_shadow_dropped_total": "shadow_dropped",
}
ROLLOUT = {
    "servekit_version_requests_total": ("counter", "Requests a version answered (split or named)"),
    "servekit_version_errors_total": (
        "counter",
        "Answers and shadow runs of a version that failed",
    ),
    "servekit_shadow_runs_total": ("counter", "Copies of requests run on the shadow version"),
    "servekit_shadow_mismatches_total": (
        "counter",
        "Shadow answers that differed from the answer returned",
    ),
    "servekit_shadow_dropped_total": ("counter", "Shadow copies dropped: too many in flight"),
    "servekit_traffic_share_percent": ("gauge", "A version's share of the split, percent"),
    "servekit_canary_window_p99_seconds": ("gauge", "p99 latency in the canary's current window"),
    "servekit_canary_verdicts_total": ("counter", "Canary verdicts: step, promoted, fail"),
}
"""Rollout's series (``servekit.rollout``): kind and help text."""


def _family(
    lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]
) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    lines.extend(
        f"{name}{{{labels}}} {_num(v)}" if labels else f"{name} {_num(v)}" for labels, v in samples
    )


def _num(v: float) -> str:
    if v != v:
        return "NaN"
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Nvml:
    """NVML GPU gauges, or nothing where there is no GPU or no ``nvidia-ml-py``."""

    def __init__(self) -> None:
        self.handles: list[tuple[str, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                self.handles.append((uuid.decode() if isinstance(uuid, bytes) else uuid, handle))
            self._nvml = pynvml
        except Exception:  # no library, no driver or no GPU: no GPU metrics
            self.handles = []

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def read(self) -> dict[str, tuple[str, list[tuple[str, float]]]]:
        if not self.handles:
            return {}
        nvml = self._nvml
        out: dict[str, tuple[str, list[tuple[str, float]]]] = {
            name: (help_text, []) for name, help_text in GPU_GAUGES.items()
        }
        for uuid, handle in self.handles:
            labels = f'gpu_uuid="{_escape(uuid)}"'
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:
                continue
            out["nv_gpu_utilization"][1].append((labels, util))
            out["nv_gpu_memory_total_bytes"][1].append((labels, float(mem.total)))
            out["nv_gpu_memory_used_bytes"][1].append((labels, float(mem.used)))
        return out
