"""A model's failures in the server log: its traceback once per distinct error and place,
then a count, so a user sees where their code failed without a flood of repeats."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

__all__ = ["FAULTS", "FaultLog", "cause", "is_out_of_memory", "same_fault"]

log = logging.getLogger("servekit.model")


def cause(exc: BaseException) -> BaseException:
    """The model's own exception behind ``exc`` (a ``RunnerError`` wraps it as its cause)."""
    while exc.__cause__ is not None and type(exc).__module__.startswith("servekit"):
        exc = exc.__cause__
    return exc


def same_fault(a: BaseException, b: BaseException) -> bool:
    """Whether two failures are one: the same exception type with the same words."""
    a, b = cause(a), cause(b)
    return type(a) is type(b) and str(a) == str(b)


def is_out_of_memory(exc: BaseException) -> bool:
    """A device out of memory (PyTorch's ``OutOfMemoryError``, CUDA's or TensorRT's words)."""
    e: BaseException | None = exc
    while e is not None:
        if type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower():
            return True
        e = e.__cause__
    return False


def _place(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename}:{last.lineno}"


class FaultLog:
    """Logs a model's exception with its traceback the first time an error of that type
    and words is raised at that place; repeats within ``window_s`` are counted and said
    in one line (``... N more in the last 60 s``) when the error comes again after it."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._seen: dict[tuple[str, str, str], list[float]] = {}  # key -> [since, repeats]
        self._lock = threading.Lock()

    def __call__(self, model: str, exc: BaseException) -> None:
        root = cause(exc)
        key = (model, f"{type(root).__name__}: {root}", _place(root))
        now = self._clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is None:
                if len(self._seen) > 1000:  # a model whose words change every time
                    self._seen.clear()
                self._seen[key] = [now, 0]
                first = True
            elif now - entry[0] < self.window_s:
                entry[1] += 1
                return
            else:
                repeats, entry[0], entry[1] = int(entry[1]), now, 0
                first = False
        if first:
            log.error(
                "model %s failed: %s (at %s)", model, key[1], key[2], exc_info=(type(root), root,
                root.__traceback__),
            )  # fmt: skip
        else:
            log.error(
                "model %s failed: %s (at %s) ... %d more in the last %g s",
                model, key[1], key[2], repeats + 1, self.window_s,
            )  # fmt: skip


FAULTS = FaultLog()
"""The process's one log of model failures (every runtime runs the core in its process)."""
