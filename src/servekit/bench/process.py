"""Servers in processes of their own, for benchmarks: ``servekit serve --config`` started,
waited for and stopped (``ServerProcess``), and any peer server command (``spawned``)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..config import ServeConfig

__all__ = ["ServerProcess", "spawned"]


@contextlib.contextmanager
def spawned(
    argv: Sequence[str], ready: Callable[[], bool], what: str, timeout_s: float = 180.0
) -> Iterator[int]:
    """A peer server (a plain Ray app, say) in a process of its own: its pid once ``ready()``
    is true; terminated (killed if it lingers) on the way out."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(Exception):
                if ready():
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.5)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


class ServerProcess:
    """``servekit serve --config`` in a process of its own: start, wait, stop (SIGTERM)."""

    def __init__(self, config: ServeConfig, *extra_args: str) -> None:
        self.config, self.extra_args = config, extra_args
        self._dir = tempfile.TemporaryDirectory(prefix="servekit-server-")
        self.log = Path(self._dir.name) / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> ServerProcess:
        path = Path(self._dir.name) / "serve.toml"
        path.write_text(self.config.to_toml())
        command = [sys.executable, "-m", "servekit", "serve", "--config", str(path)]
        with self.log.open("wb") as log:
            # A session of its own: a runtime that signals its process group on the way out
            # (Ray's node shutdown) must not take the measuring process with it.
            self.proc = subprocess.Popen(
                [*command, *self.extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self, models: Sequence[str], timeout_s: float = 300.0) -> None:
        from ..client import Client

        deadline = time.monotonic() + timeout_s
        url = self.config.server.http_url
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-3000:]}")
            try:
                with Client(url) as client:
                    if client.is_ready() and all(client.is_ready(m) for m in models):
                        return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{models} not ready in {timeout_s} s: {self.log.read_text()[-3000:]}"
                )
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
