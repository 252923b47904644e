"""Processes a server started, found by where their executable lies (Linux ``/proc``)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["descendants", "end_processes", "kill_leftovers", "listening_ports", "processes"]

log = logging.getLogger(__name__)


def processes(prefix: str) -> dict[int, list[str]]:
    """Live (not zombie) processes whose executable lies under ``prefix``: pid -> argv
    (Linux ``/proc``; empty elsewhere)."""
    found: dict[int, list[str]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (
                (entry / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            )
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if argv[0].startswith(prefix) and not zombie:
            found[int(entry.name)] = argv
    return found


def kill_leftovers(prefix: str) -> int:
    """SIGKILL processes started from ``prefix`` that outlived their server; returns how many.

    When tritonserver dies at shutdown, its Python backend stubs can outlive it (their
    parent becomes init). Each holds memory; this finds them by the executable path under
    the server's private workspace.
    """
    killed = set()
    for pid in processes(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        except OSError:
            pass
    if killed:
        log.warning("killed %d process(es) left behind under %s", len(killed), prefix)
    # A SIGKILL lands when the process next runs (on a starved host, a while later): gone
    # on return, so nothing it holds is freed under it and a caller's look finds none.
    deadline = time.monotonic() + LEFTOVER_GONE_S
    while killed and killed & processes(prefix).keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(killed)


LEFTOVER_GONE_S = 10.0
"""How long ``kill_leftovers`` waits for the processes it killed to be gone."""


def descendants(root: int | None = None) -> dict[int, list[str]]:
    """Live (not zombie) processes below ``root`` (default: this one): pid -> argv (Linux
    ``/proc``; empty elsewhere)."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    argv: dict[int, list[str]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            pid = int(entry.name)
            parent[pid] = int(fields[1])
            argv[pid] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
    below: dict[int, list[str]] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in below}
        below.update({pid: argv[pid] for pid in frontier})
    return below


def listening_ports(pids: Iterable[int]) -> dict[int, set[int]]:
    """The TCP ports each of ``pids`` listens on, by pid (Linux ``/proc``: a socket the
    process holds open that ``/proc/net/tcp`` or ``tcp6`` lists in state LISTEN; empty
    elsewhere, and for a process that is gone)."""
    listen: dict[str, int] = {}  # socket inode -> port
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                listen[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    found: dict[int, set[int]] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        ports = set()
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile (the listing's own descriptor, say)
                continue
            if link.startswith("socket:[") and link[8:-1] in listen:
                ports.add(listen[link[8:-1]])
        if ports:
            found[pid] = ports
    return found


def end_processes(pids: Iterable[int], grace_s: float = 5.0) -> int:
    """SIGTERM ``pids``, SIGKILL those still alive after ``grace_s``; returns how many
    were still running."""
    alive = [pid for pid in pids if _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _running(pid)]
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    return len(alive)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    return True


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
