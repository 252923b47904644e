"""The autoscaling signal and model readiness on the Triton runtimes: tritonserver runs
the batches, so the front reads its counters (``nv_inference_*`` on its metrics port, the
same meanings servekit's runtimes export) and each model's readiness at each scrape of
the front, and exports ``servekit_replicas_needed`` (``servekit.autoscale``) and
``servekit_model_ready`` per model from them, as servekit's own runtimes do."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import urllib.request
from collections.abc import Mapping

from ..autoscale import AutoscalePolicy, Counters, Demand
from ..metrics import DEMAND, GAUGES, READY, Family

__all__ = ["TritonDemand", "parse_counters"]

_SAMPLE = re.compile(r"^(nv_inference_[a-z_]+)\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_FIELDS = {
    "nv_inference_request_success": "requests",
    "nv_inference_count": "rows",
    "nv_inference_exec_count": "executions",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_infer_duration_us": "compute_us",
}


def parse_counters(text: str) -> dict[tuple[str, str], Counters]:
    """(model, version) -> its counters, from a Prometheus exposition of Triton's names."""
    found: dict[tuple[str, str], dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m[1] not in _FIELDS:
            continue
        labels = dict(_LABEL.findall(m[2]))
        key = (labels.get("model", ""), labels.get("version", ""))
        found.setdefault(key, {})[_FIELDS[m[1]]] = float(m[3])
    return {key: Counters(**values) for key, values in found.items()}


class TritonDemand:
    """``Metrics.collect`` source: reads tritonserver's metrics and each model's
    max_batch_size and instances (its model config, once), and observes each model's
    ``Demand``."""

    def __init__(
        self, metrics_url: str, http_url: str, policies: Mapping[str, AutoscalePolicy]
    ) -> None:
        self.metrics_url, self.http_url, self.policies = metrics_url, http_url, policies
        self._demand: dict[tuple[str, str], Demand] = {}
        self._lock = threading.Lock()
        # A first reading now (tritonserver runs already): the signal's window starts at
        # the front's start, not at the first scrape, which may come after a burst.
        with contextlib.suppress(Exception):
            self()

    def _ready(self, model: str, version: str) -> bool:
        url = f"{self.http_url}/v2/models/{model}/versions/{version}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _shape(self, model: str) -> tuple[int, int, float]:
        """The model's max_batch_size, its instances (the instance groups' counts) and its
        dynamic batcher's hold (max_queue_delay_microseconds)."""
        url = f"{self.http_url}/v2/models/{model}/config"
        with urllib.request.urlopen(url, timeout=2) as r:
            config = json.loads(r.read())
        groups = config.get("instance_group") or [{}]
        instances = sum(int(g.get("count", 1)) for g in groups)
        hold = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0)
        return int(config.get("max_batch_size", 0)) or 1, max(instances, 1), float(hold)

    def __call__(self) -> list[Family]:
        with self._lock:  # scrapes render on threads of their own
            return self._read()

    def _read(self) -> list[Family]:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                counters = parse_counters(r.read().decode())
        except OSError:  # tritonserver restarting: no reading this time
            return []
        samples, ready = [], []
        for (model, version), now in sorted(counters.items()):
            labels = {"model": model, "version": version}
            ready.append((labels, float(self._ready(model, version))))
            # Readings start at first sight; the model's max_batch_size (its config, which
            # a busy tritonserver may be slow to answer) is asked for until it comes.
            demand = self._demand.setdefault((model, version), Demand(0))
            if not demand.max_batch_size:
                with contextlib.suppress(OSError, ValueError):
                    demand.max_batch_size, demand.instances, demand.hold_us = self._shape(model)
            # PyTriton binds version N of a routed model as "<name>.v<N>".
            demand.policy = self.policies.get(re.sub(r"\.v\d+$", "", model), demand.policy)
            needed = demand.observe(now)
            if demand.max_batch_size:
                samples.append((labels, needed))
        return [(DEMAND, "gauge", GAUGES[DEMAND], samples), (READY, "gauge", GAUGES[READY], ready)]
