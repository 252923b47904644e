"""What a model costs resident, measured alone: a helper process loads and warms it up
with nothing else running, and reports the settled growth of its memory.

Measured in the serving process, a load's growth also counts whatever its other threads
allocate in the same window (requests, batches, other models' warm-ups): the store's
charges came out at two to four times a model's real cost under eight clients, and the
budget then held one model where it had room for three. The helper is quiet, so each
model's figure is its own; it is kept per model file and configuration, so each model is
measured once however often it is evicted, and the figure never drifts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from ..config import ModelConfig
from ..storage import StorageConfig
from .memory import release_freed, resident_bytes

__all__ = ["Meter", "measure_alone"]

PRIMING_LOADS = 2
"""Loads of the helper's first model before any reading: the engine's one-time start
(its runtime, thread pools, the allocator's arenas) took two to settle here."""
READINGS = 2
"""Readings averaged per model: one reading is a whole number of allocator chunks and
swung 4.2-5.1 MB for a model whose loads settle at 5.2 MB each."""

log = logging.getLogger(__name__)


def measure_alone(
    load: Callable[[], Any], release: Callable[[Any], None], measure: Callable[[], int]
) -> int:
    """The settled growth of ``measure`` across ``load`` (and its warm-up): memory the
    allocator can give back is given back before both readings, so load-time scratch does
    not count; what was loaded is released afterwards."""
    release_freed()
    before = measure()
    loaded = load()
    try:
        release_freed()
        return max(0, measure() - before)
    finally:
        release(loaded)


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("!Q", len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    (size,) = struct.unpack("!Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(data)


def _serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The helper's loop: ``(cache_dir, storage)`` first, then a config in and
    ``("ok", bytes)`` or ``("error", why)`` out, until the pipe closes."""
    from ..batching import Batcher
    from ..runners.base import warm_up
    from ..runtime.base import load_models

    cache_dir, storage = _receive(requests)

    def load(config: ModelConfig) -> Any:
        served = load_models(config, cache_dir, storage)
        for m in served:
            warm_up(m.runner, m.name)
        # Served, a model also has its Batchers, whose worker threads start with the first
        # batch: part of what it costs (about 0.6 MB a model here).
        batchers = [
            Batcher(m.runner, m.policy, instance_count=m.instance_count, name=m.name)
            for m in served
        ]
        tensor = batchers[0]
        asyncio.run(tensor.infer(tensor.spec.sample_inputs(1)))
        return served, batchers

    def release(loaded: Any) -> None:
        served, batchers = loaded
        for batcher in batchers:
            batcher.close()
        for runner in {id(m.runner): m.runner for m in served}.values():
            runner.close()
        release_freed()

    primed = False
    while True:
        try:
            config = _receive(requests)
        except EOFError:
            return
        try:
            if not primed:  # the engine's one-time start is no model's memory
                for _ in range(PRIMING_LOADS):
                    release(load(config))
                resident_bytes()  # its first call imports NVML's bindings
                primed = True
            readings = [
                measure_alone(functools.partial(load, config), release, resident_bytes)
                for _ in range(READINGS)
            ]
            _send(answers, ("ok", sum(readings) // len(readings)))
        except Exception as exc:
            _send(answers, ("error", f"{type(exc).__name__}: {exc}"))


class Meter:
    """Each model's resident cost, measured once in a helper process and kept per model
    file (path, size, modification time) and configuration. ``charge`` answers None where
    the helper cannot measure it (the model does not load there, or the helper died or
    took longer than ``timeout_s``): the store then measures the load itself. The helper
    (about 90 MB with ONNX Runtime loaded) stops after ``idle_s`` with nothing to measure
    and starts again, in about a second, for the next model."""

    def __init__(
        self,
        cache_dir: str | None = None,
        storage: StorageConfig | None = None,
        *,
        timeout_s: float = 300.0,
        idle_s: float = 10.0,
    ) -> None:
        self._cache_dir, self._storage, self._timeout_s = cache_dir, storage, timeout_s
        self._idle_s = idle_s
        self._known: dict[tuple[Any, ...], int] = {}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._idle: threading.Timer | None = None

    def charge(self, config: ModelConfig, path: str | None) -> int | None:
        """``config``'s resident bytes (``path``: its resolved file, None where unknown)."""
        key = _key(config, path)
        with self._lock:
            if key in self._known:
                return self._known[key]
            if self._idle is not None:
                self._idle.cancel()
            answer = self._ask(config)
            if answer is not None:
                self._known[key] = answer
            self._idle = threading.Timer(self._idle_s, self.close)
            self._idle.daemon = True
            self._idle.start()
            return answer

    def _ask(self, config: ModelConfig) -> int | None:
        try:
            process = self._helper()
            assert process.stdin is not None and process.stdout is not None
            _send(process.stdin, config)
            ready, _, _ = select.select([process.stdout], [], [], self._timeout_s)
            if not ready:
                raise TimeoutError(f"no answer in {self._timeout_s:.0f} s")
            status, value = _receive(process.stdout)
        except (OSError, EOFError, TimeoutError, pickle.PickleError) as exc:
            log.warning("store: the meter could not measure %s (%s); measuring in place",
                        config.name, exc)  # fmt: skip
            self._stop()
            return None
        if status != "ok":
            log.info("store: the meter could not load %s: %s", config.name, value)
            return None
        return int(value)

    def _helper(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self._stop()
            self._process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import main; main()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert self._process.stdin is not None
            _send(self._process.stdin, (self._cache_dir, self._storage))
        return self._process

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            process.wait(2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(2)

    def close(self) -> None:
        """Stop the helper (it starts again on the next ``charge``)."""
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            self._stop()

    @property
    def running(self) -> bool:
        """Whether the helper process is up now."""
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key(config: ModelConfig, path: str | None) -> tuple[Any, ...]:
    try:
        stat = os.stat(path) if path else None
    except OSError:
        stat = None
    return (repr(config), path, stat and stat.st_size, stat and stat.st_mtime_ns)


def main() -> None:
    """The helper process: the protocol owns the real stdout; anything the engines print
    goes to stderr."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, answers)
