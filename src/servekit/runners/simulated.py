"""A simulated accelerator: batch times that follow a device profile, without spending CPU.

servekit's figures on this machine are CPU figures, where the model's own time hides what
the serving path costs. A fast device changes that: at thousands of images a second the
model takes about a millisecond a batch, and whether the device stays busy depends on
the CPU the server spends per request. A model file that declares
``servekit.device_profile`` in its metadata (the zoo's ``sim_t4``) is served by
``SimulatedDevice``: each batch takes ``fixed_us + per_row_us * rows`` of wall time,
during which the caller sleeps (no CPU, no GIL), one batch at a time per device across
every process on the machine (a file lock, as on one GPU shared by Triton's instances).

With ``SERVEKIT_DEVICE_TIMELINE`` naming a file, every batch appends one JSON line to it
(from whichever process runs it: a Triton stub, a Ray replica): when the runner was handed
the batch, when the device took it and let it go (``time.time``), its rows, the
process and the device's name; ``servekit.bench.timeline`` reads them back to show where a device idles.
"""

from __future__ import annotations

import contextvars
import dataclasses
import fcntl
import json
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .base import Arrays, BaseRunner, Runner

__all__ = ["HANDED", "PROFILE_KEY", "TIMELINE_ENV", "DeviceProfile", "SimulatedDevice"]

PROFILE_KEY = "servekit.device_profile"
TIMELINE_ENV = "SERVEKIT_DEVICE_TIMELINE"

HANDED: contextvars.ContextVar[float | None] = contextvars.ContextVar("handed", default=None)
"""When the batch now being run was handed to its instance (``time.time``), where that was
before the runner was called: an instance that queues the next batch while the device
runs one (``servekit.triton.pipeline``) sets it, so the timeline shows the overlap."""

_DEVICES: dict[str, threading.Lock] = {}
"""One lock per device in this process (the file lock serializes processes, not threads)."""


@dataclass(frozen=True)
class DeviceProfile:
    """How long the device takes for a batch: ``fixed_us + per_row_us * rows``, and how
    many rows fit its memory (``max_rows``, 0 = any number)."""

    name: str
    fixed_us: float
    per_row_us: float
    max_rows: int = 0

    def batch_s(self, rows: int) -> float:
        return (self.fixed_us + self.per_row_us * rows) / 1e6

    def ceiling(self, max_batch_size: int) -> float:
        """Rows per second with every batch full: what the device can do at most."""
        return max_batch_size / self.batch_s(max_batch_size)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> DeviceProfile | None:
        if PROFILE_KEY not in metadata:
            return None
        data = json.loads(metadata[PROFILE_KEY])
        return cls(
            str(data["name"]),
            float(data["fixed_us"]),
            float(data["per_row_us"]),
            int(data.get("max_rows", 0)),
        )

    def to_metadata(self) -> dict[str, str]:
        return {PROFILE_KEY: json.dumps(dataclasses.asdict(self))}


class SimulatedDevice(BaseRunner):
    """A device with ``runner``'s signature (``runner`` is closed once read) whose batches take the profile's time on one
    shared device. It answers zeros of the right shapes: the model's own arithmetic would
    spend the CPU a real accelerator does not."""

    def __init__(self, runner: Runner, profile: DeviceProfile) -> None:
        if profile.max_rows and runner.spec.max_batch_size > profile.max_rows:
            runner.close()
            raise ValueError(
                f"max_batch_size {runner.spec.max_batch_size} does not fit device "
                f"{profile.name!r}: its memory holds batches of at most {profile.max_rows} rows"
            )
        self.profile = profile
        self._spec = runner.spec
        self.metadata = dict(getattr(runner, "metadata", None) or {})
        runner.close()  # only its signature is needed: an idle ONNX Runtime pool still spins
        self.check_outputs = False  # the wrapped runner checks its own
        self.accelerated = True
        lock = (
            Path(tempfile.gettempdir()) / f"servekit-device-{profile.name.replace('/', '_')}.lock"
        )
        self._lock = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        self._device = _DEVICES.setdefault(profile.name, threading.Lock())
        timeline = os.environ.get(TIMELINE_ENV)
        self._timeline = (
            os.open(timeline, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666) if timeline else -1
        )

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        rows = len(next(iter(inputs.values()))) if self._spec.batched else 1
        handed = HANDED.get() or time.time()
        with self._device:
            return self._compute(rows, handed)

    def _compute(self, rows: int, handed: float) -> Arrays:
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # one batch at a time on the device
        try:
            took = time.time()
            start = time.perf_counter()
            outputs = {
                t.name: np.zeros(
                    (rows, *(max(d, 1) for d in t.shape)) if self._spec.batched else t.shape,
                    dtype=t.dtype.numpy,
                )
                for t in self._spec.outputs
            }
            remaining = start + self.profile.batch_s(rows) - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)  # the device computes; the CPU (and the GIL) are free
            if self._timeline >= 0:  # one write: whole lines, whichever process appends
                line = {"handed": handed, "start": took, "end": time.time(), "rows": rows,
                        "pid": os.getpid(), "device": self.profile.name}  # fmt: skip
                os.write(self._timeline, (json.dumps(line) + "\n").encode())
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
        return outputs

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        pass

    def close(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
        if self._timeline >= 0:
            os.close(self._timeline)
            self._timeline = -1
