"""``Supervisor``: the one loop that runs a runtime until it is told to stop.

SIGINT/SIGTERM stop the runtime cleanly, also while it is still starting (a signal then
interrupts the start, and whatever was started is stopped). SIGHUP reloads the models
from their files (``Runtime.reload``); a reload that fails is logged and the serving
version stays. Every ``check_s`` the runtime is asked for a ``problem``; a runtime that
has one is restarted on the same ports, up to ``max_restarts`` times.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from .base import Runtime

__all__ = ["Supervisor"]

log = logging.getLogger("servekit")


class Supervisor:
    """Runs ``runtime`` in the foreground: start, watch, reload on SIGHUP, stop on a signal."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_restarts: int = 5,
        check_s: float = 1.0,
        on_event: Callable[[str], None] | None = None,
        on_reload: Callable[[], list[str]] | None = None,
        restart_window_s: float = 600.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        self.runtime = runtime
        self._on_reload = on_reload
        self.max_restarts = max_restarts
        self.check_s = check_s
        self.restart_window_s = restart_window_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.restarts = 0
        self._recent: list[float] = []
        """When the restarts within ``restart_window_s`` happened."""
        self._say = on_event or log.info
        self._stop = threading.Event()
        self._hup = threading.Event()
        self._wake = threading.Event()
        self._started = False

    def request_stop(self) -> None:
        """Ask ``run`` to stop the runtime and return (thread-safe)."""
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        """Ask ``run`` to reload the models (thread-safe)."""
        self._hup.set()
        self._wake.set()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop()
        if not self._started:  # interrupt a start that may take a while
            raise KeyboardInterrupt

    def run(self) -> int:
        """Serve until a stop signal; returns the exit code (0, or 1 when the runtime died
        more often than ``max_restarts``)."""
        previous = self._install()
        try:
            try:
                self.runtime.start()
                self._started = True
            except KeyboardInterrupt:
                return 0
            self._install()  # again: starting Ray replaces the SIGTERM handler with an abort
            self._say("serving: SIGHUP reloads the models, SIGINT or SIGTERM stops")
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self.runtime.stop()

    def _install(self) -> dict[int, object]:
        """Take SIGINT, SIGTERM and SIGHUP (from the main thread only); returns the handlers
        they had."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, object] = {
            sig: signal.signal(sig, self._on_stop) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: self.request_reload())
        return previous

    def _reload(self) -> None:
        for step in (self._on_reload, self.runtime.reload):
            if step is None:
                continue
            try:
                for line in step():
                    self._say(line)
            except Exception as exc:  # a failed update must not stop the serving version
                self._say(f"reload failed, the serving version stays: {exc}")

    def _watch(self) -> int:
        while not self._stop.is_set():
            self._wake.wait(self.check_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            if self._hup.is_set():
                self._hup.clear()
                self._reload()
            problem = self.runtime.problem()
            if problem is None:
                continue
            now = time.monotonic()
            self._recent = [t for t in self._recent if now - t < self.restart_window_s]
            if len(self._recent) >= self.max_restarts:
                self._say(
                    f"{problem}; gave up after {len(self._recent)} restart(s) within "
                    f"{self.restart_window_s:g} s"
                )
                return 1
            # The first restart is at once; each one after it within the window waits
            # twice as long as the last, so a server that keeps dying is not hammered.
            delay = min(self.backoff_s * 2 ** (len(self._recent) - 1), self.max_backoff_s)
            n = f"({len(self._recent) + 1}/{self.max_restarts})"
            if self._recent:
                self._say(f"{problem}; restarting in {delay:g} s {n}")
                if self._stop.wait(delay):
                    break
            else:
                self._say(f"{problem}; restarting {n}")
            self._recent.append(time.monotonic())
            self.restarts += 1
            try:
                self.runtime.restart()
            except Exception as exc:  # the next check sees the problem and tries again
                self._say(f"restart failed: {type(exc).__name__}: {exc}")
                continue
            self._say("restarted")
        return 0
