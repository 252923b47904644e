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
import struct
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
    many rows fit its memory (``max_rows``, 0 = any number).

    ``queued``: the device runs work as a GPU's stream does: a batch handed over while
    another runs starts the moment that one ends, with no host thread waking in between
    (a runner that enqueues its copy and launch asynchronously, as ``TorchRunner``'s
    lanes do). Otherwise a batch starts only once its caller takes the free device."""

    name: str
    fixed_us: float
    per_row_us: float
    max_rows: int = 0
    queued: bool = False

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
            bool(data.get("queued", False)),
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
        if self.profile.queued:
            return self._enqueue(rows, handed)
        with self._device:
            return self._compute(rows, handed)

    def _outputs(self, rows: int) -> Arrays:
        return {
            t.name: np.zeros(
                (rows, *(max(d, 1) for d in t.shape)) if self._spec.batched else t.shape,
                dtype=t.dtype.numpy,
            )
            for t in self._spec.outputs
        }

    def _enqueue(self, rows: int, handed: float) -> Arrays:
        """A queued device: the lock file holds when the device frees (``time.time``); the
        batch runs from then (or now) for its time, and its caller waits for its end."""
        outputs = self._outputs(rows)
        with self._device:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            try:
                now = time.time()
                free = os.pread(self._lock, 8, 0)
                start = max(now, struct.unpack("d", free)[0] if len(free) == 8 else 0.0)
                end = start + self.profile.batch_s(rows)
                os.pwrite(self._lock, struct.pack("d", end), 0)
            finally:
                fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._record(handed, start, end, rows)
        remaining = end - time.time()
        if remaining > 0:
            time.sleep(remaining)  # the device computes; the CPU (and the GIL) are free
        return outputs

    def _record(self, handed: float, start: float, end: float, rows: int) -> None:
        if self._timeline >= 0:  # one write: whole lines, whichever process appends
            line = {"handed": handed, "start": start, "end": end, "rows": rows,
                    "pid": os.getpid(), "device": self.profile.name}  # fmt: skip
            os.write(self._timeline, (json.dumps(line) + "\n").encode())

    def _compute(self, rows: int, handed: float) -> Arrays:
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # one batch at a time on the device
        try:
            took = time.time()
            start = time.perf_counter()
            outputs = self._outputs(rows)
            remaining = start + self.profile.batch_s(rows) - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)  # the device computes; the CPU (and the GIL) are free
            self._record(handed, took, time.time(), rows)
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
