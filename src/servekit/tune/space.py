"""The search space of ``servekit tune``: the knobs Model Analyzer searches, as a grid.

A point is one value per knob (max batch size, instance count, max queue delay, threads
per instance, and on the Triton runtimes whether an instance overlaps the hand-over of
its next batch with the device's work); ``SearchSpace.config`` turns a point into the ``ServeConfig`` a runtime is
started with, so what is measured is exactly what ``best.toml`` says.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..config import ServeConfig

__all__ = ["KNOBS", "Knobs", "SearchSpace"]

KNOBS = ("max_batch_size", "instances", "max_queue_delay_us", "threads", "overlap")
"""In the order the quick search tries them: the knob that moves throughput most first."""


@dataclass(frozen=True, order=True)
class Knobs:
    """One candidate: a value per knob (``threads`` None = ONNX Runtime's default)."""

    max_batch_size: int
    instances: int
    max_queue_delay_us: int
    threads: int | None
    overlap: bool | None = None
    """``[models] overlap``: None = the default (where the model runs off the host's CPU)."""

    def label(self) -> str:
        threads = "default" if self.threads is None else self.threads
        batch = self.max_batch_size or "the model's own"
        return (
            f"batch {batch}, instances {self.instances}, "
            f"delay {self.max_queue_delay_us} us, threads {threads}"
            + ("" if self.overlap is None else f", overlap {'on' if self.overlap else 'off'}")
        )


@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take; a knob with one value is held fixed."""

    max_batch_size: tuple[int, ...] = (1, 4, 8, 16)
    instances: tuple[int, ...] = (1, 2)
    max_queue_delay_us: tuple[int, ...] = (0, 500, 2000)
    threads: tuple[int | None, ...] = (None,)
    overlap: tuple[bool | None, ...] = (None,)
    """``[models] overlap``, which the Triton runtimes and Ray act on (``tune`` holds it at
    the config's own value on native): the default first, then off before on, so the quick
    search measures the hand-over as it is and proposes overlap where it beats it."""

    def __post_init__(self) -> None:
        for knob in KNOBS:
            values = tuple(getattr(self, knob))
            if not values:
                raise ValueError(f"the search space needs at least one value of {knob}")
            if len(set(values)) != len(values):
                raise ValueError(f"{knob} values repeat: {list(values)}")
            numbers = [v for v in values if v is not None and not isinstance(v, bool)]
            lowest = 0 if knob == "max_queue_delay_us" else 1
            if any(v < lowest for v in numbers):
                raise ValueError(f"{knob} values must be >= {lowest}, got {list(values)}")
            # Sorted, so that a neighbour is the next value up or down (None first).
            object.__setattr__(
                self, knob, tuple(sorted(values, key=lambda v: -1 if v is None else v))
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(getattr(self, k)) for k in KNOBS)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def knobs(self, index: Sequence[int]) -> Knobs:
        return Knobs(*(getattr(self, k)[i] for k, i in zip(KNOBS, index, strict=True)))

    def indices(self) -> Iterator[tuple[int, ...]]:
        """Every point, in grid order."""
        return itertools.product(*(range(s) for s in self.shape))

    def neighbours(self, index: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The points one step away along one knob, knob by knob (``KNOBS``' order),
        up before down."""
        for axis, size in enumerate(self.shape):
            for step in (1, -1):
                moved = index[axis] + step
                if 0 <= moved < size:
                    yield (*index[:axis], moved, *index[axis + 1 :])

    def config(self, base: ServeConfig, knobs: Knobs) -> ServeConfig:
        """``base`` (one model) with the candidate's knobs, a fixed configuration (no
        latency budget); preferred batch sizes above its max batch size are dropped."""
        (model,) = base.models
        batching = dataclasses.replace(
            model.batching,
            max_batch_size=knobs.max_batch_size,
            preferred_batch_sizes=tuple(
                p for p in model.batching.preferred_batch_sizes if p <= knobs.max_batch_size
            ),
            max_queue_delay_us=knobs.max_queue_delay_us,
            latency_budget_ms=0.0,  # a candidate is a fixed configuration
        )
        tuned = dataclasses.replace(
            model,
            batching=batching,
            instances=knobs.instances,
            threads=knobs.threads,
            overlap=knobs.overlap,
        )
        return base.replace(models=(tuned,))

    def adaptive(self, base: ServeConfig, knobs: Knobs, budget_ms: float) -> ServeConfig:
        """The candidate's max batch size, instances and threads with the batcher's own
        latency budget in place of a queue delay and preferred sizes."""
        (model,) = (fixed := self.config(base, knobs)).models
        batching = dataclasses.replace(
            model.batching, preferred_batch_sizes=(), max_queue_delay_us=0,
            latency_budget_ms=budget_ms,
        )  # fmt: skip
        autoscale = dataclasses.replace(model.autoscale, latency_budget_ms=budget_ms)
        adaptive = dataclasses.replace(model, batching=batching, autoscale=autoscale)
        return fixed.replace(models=(adaptive,))
