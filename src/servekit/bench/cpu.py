"""CPU time and memory of a process tree (Linux ``/proc``): what a server spends per request.

A server is a tree of processes (tritonserver and its Python backend stubs, Ray's GCS,
raylet and workers); its cost is the CPU time of the whole tree over a measurement
divided by the requests answered, a figure that survives a noisy shared machine better
than throughput does.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from ..store.memory import rss_bytes

__all__ = [
    "PeakRss",
    "TreeCpu",
    "descendants",
    "title",
    "tree_cpu_by_title",
    "tree_cpu_s",
    "tree_fds",
    "tree_rss_bytes",
]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # fields from the state on (comm may hold spaces)


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of ``pid``'s live tree, plus what its exited children used
    (their time is folded into their waiting parents')."""
    total = 0
    for p in descendants(pid):
        fields = _stat(p)
        if fields is not None:
            # utime, stime, cutime, cstime are fields 14-17 of stat (1-based), 11-14 here.
            total += sum(int(v) for v in fields[11:15])
    return total / _TICK


def title(pid: int) -> str:
    """What a process calls itself: Ray's workers their ``ray::`` title (the actor's
    class and deployment), any other its program's name (``raylet``, ``python``...)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):  # less the method it runs now (".handle_request...")
        return first.split(".")[0]
    return Path(first.split(" ")[0]).name


def tree_cpu_by_title(pid: int) -> dict[str, float]:
    """User + system seconds of ``pid``'s live tree, summed per process ``title``: where a
    server's CPU goes, hop by hop."""
    out: dict[str, float] = {}
    for p in descendants(pid):
        fields = _stat(p)
        if fields is not None:
            name = title(p)
            out[name] = out.get(name, 0.0) + sum(int(v) for v in fields[11:13]) / _TICK
    return out


class TreeCpu:
    """CPU seconds a process tree used since the last ``lap`` (or since construction)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._last = tree_cpu_s(pid)

    def lap(self) -> float:
        now = tree_cpu_s(self.pid)
        used, self._last = now - self._last, now
        return used


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid``'s live tree (shared pages count once per process; a
    process that exited meanwhile counts 0)."""
    return sum(rss_bytes(p) for p in descendants(pid))


def tree_fds(pid: int, skip: tuple[str, ...] = ()) -> int:
    """Open file descriptors of ``pid``'s live tree (sockets included), less those whose
    target starts with one of ``skip`` (e.g. ``/dev/shm/``: pools of shared memory)."""
    total = 0
    for p in descendants(pid):
        with contextlib.suppress(OSError):  # exited meanwhile
            fds = os.listdir(f"/proc/{p}/fd")
            if skip:
                fds = [f for f in fds if not _target(p, f).startswith(skip)]
            total += len(fds)
    return total


def _target(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:  # closed meanwhile
        return ""


class PeakRss:
    """The highest ``tree_rss_bytes(pid)`` seen while in the ``with`` block, sampled
    every ``interval_s`` on a thread of its own."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
