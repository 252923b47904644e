"""What a ``ModelStore`` reports of its units: Triton's repository index (with charges),
the Prometheus families, and the counts summed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .unit import COUNTS, Unit

__all__ = ["Family", "figures", "index", "totals"]

Family = tuple[str, str, str, list[tuple[dict[str, str], float]]]
"""(name, kind, help, [(labels, value)])"""


def totals(units: Iterable[Unit]) -> dict[str, float]:
    """Loads, unloads, evictions, load seconds, refusals and dropped loads, summed."""
    out = dict.fromkeys(COUNTS, 0.0)
    for entry in units:
        for key in out:
            out[key] += entry.counts[key]
    return out


def index(units: Iterable[Unit]) -> list[dict[str, Any]]:
    """Triton's repository index of every known model, with what it is charged."""
    out = []
    for e in sorted(units, key=lambda e: (e.model, e.number)):
        row: dict[str, Any] = {"name": e.model, "version": str(e.number), "state": e.state}
        if e.reason:
            row["reason"] = e.reason
        if e.resident is not None:
            row["resident_bytes"] = e.resident.charged
            row["in_flight"] = e.resident.in_flight
        if e.waiting:
            row["waiting"] = e.waiting
        out.append(row)
    return out


def figures(units: Iterable[Unit], budget: int) -> Iterable[Family]:
    """Prometheus families: (name, kind, help, [(labels, value)])."""
    per_model = {
        "servekit_store_loads_total": ("counter", "Loads of the model", "loads"),
        "servekit_store_unloads_total": ("counter", "Unloads on request", "unloads"),
        "servekit_store_evictions_total": ("counter", "Evictions for room", "evictions"),
        "servekit_store_load_seconds_total": (
            "counter", "Seconds spent loading and warming up the model", "load_seconds",
        ),
        "servekit_store_refusals_total": (
            "counter", "Requests refused (503) after waiting wait_s for the model",
            "refusals",
        ),
        "servekit_store_dropped_loads_total": (
            "counter", "Loads on demand dropped because no request waited any more",
            "dropped",
        ),
    }  # fmt: skip
    rows = [
        ({"model": e.model, "version": str(e.number)}, e)
        for e in sorted(units, key=lambda e: (e.model, e.number))
    ]
    for metric, (kind, help_text, key) in per_model.items():
        yield metric, kind, help_text, [(labels, e.counts[key]) for labels, e in rows]
    yield (
        "servekit_store_resident_bytes", "gauge",
        "Memory the model is charged while resident (0 when not)",
        [(labels, float(e.resident.charged if e.resident else 0)) for labels, e in rows],
    )  # fmt: skip
    yield (
        "servekit_store_waiting_requests", "gauge",
        "Requests waiting for the model to be loaded",
        [(labels, float(e.waiting)) for labels, e in rows],
    )  # fmt: skip
    yield (
        "servekit_store_budget_bytes", "gauge",
        "The store's memory budget (0: none)", [({}, float(budget))],
    )  # fmt: skip
