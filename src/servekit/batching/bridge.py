"""The batcher's event loop, and the bridge to it from threaded callers.

Scheduling runs on one asyncio loop: the first ``await infer`` caller's loop (no thread
hop per request), or a private loop thread started for threaded callers. Threads hand
requests over through an inbox: one wake-up of the loop per burst, not one per request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable

from ..errors import ModelNotReady
from .request import Request

__all__ = ["LoopBridge"]


class LoopBridge:
    """The loop one batcher schedules on, and the way in for threads.

    Args:
        name: used in the private loop thread's name and in errors.
        admit: called on the loop with each request a thread submitted.
    """

    def __init__(self, name: str, admit: Callable[[Request], None]) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.accepting = True  # guarded by _lock: threads may still hand requests to the loop
        self._admit = admit
        self._lock = threading.Lock()
        self._inbox: collections.deque[Request] = collections.deque()  # guarded by _lock
        self._signalled = False
        self._thread_id: int | None = None
        self._private: threading.Thread | None = None
        self.on_bind: Callable[[asyncio.AbstractEventLoop], None] = lambda loop: None

    def bind(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Make ``loop`` (the running one) the scheduling loop if none is usable; False if
        another loop is."""
        with self._lock:
            current = self.loop
            if current is loop:
                return True
            if current is not None and not current.is_closed():
                return False
            self._set(loop, threading.get_ident())
            return True

    def submit(self, request: Request) -> None:
        """Hand ``request`` to the loop from any thread (starts a private loop if none runs).

        Raises:
            ModelNotReady: the batcher no longer accepts requests.
        """
        with self._lock:
            if not self.accepting:
                raise ModelNotReady(f"{self.name}: batcher is closed")
            loop = self._ensure_loop()
            self._inbox.append(request)
            if not self._signalled:
                self._signalled = True
                loop.call_soon_threadsafe(self._drain)

    def stop_accepting(self) -> None:
        with self._lock:
            self.accepting = False

    def on_own_loop(self) -> bool:
        """Whether the caller is on the running scheduling loop (blocking there would deadlock)."""
        loop = self.loop
        return (
            loop is not None
            and loop.is_running()
            and not loop.is_closed()
            and self._thread_id == threading.get_ident()
        )

    def running(self) -> asyncio.AbstractEventLoop | None:
        """The scheduling loop, if it is running."""
        loop = self.loop
        return loop if loop is not None and not loop.is_closed() and loop.is_running() else None

    def call_soon(self, fn: Callable[..., None], *args: object) -> bool:
        """Run ``fn(*args)`` on the loop from any thread; False when the loop is gone."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed under us
            return False
        return True

    def close(self) -> None:
        """Stop and close the private loop, if this bridge started one."""
        thread, loop = self._private, self.loop
        if thread is not None and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._private = None

    def _set(self, loop: asyncio.AbstractEventLoop, thread_id: int | None) -> None:
        self.loop, self._thread_id = loop, thread_id
        self.on_bind(loop)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The scheduling loop for thread callers; starts a private one if none runs
        (holds _lock)."""
        if self.loop is not None and not self.loop.is_closed():
            return self.loop
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._thread_id = threading.get_ident()
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=run, name=f"servekit-{self.name}-loop", daemon=True)
        self._private = thread
        self._set(loop, None)
        thread.start()
        ready.wait()
        return loop

    def _drain(self) -> None:
        with self._lock:
            requests = list(self._inbox)
            self._inbox.clear()
            self._signalled = False
        for request in requests:
            self._admit(request)
