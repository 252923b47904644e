"""Processes a server started, found by where their executable lies (Linux ``/proc``)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

__all__ = ["kill_leftovers", "processes"]

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
    killed = 0
    for pid in processes(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    if killed:
        log.warning("killed %d process(es) left behind under %s", killed, prefix)
    return killed
