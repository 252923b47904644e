"""The process's resident memory, as the budget charges it."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["release_freed", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size in bytes (Linux ``/proc/<pid>/statm``; 0 where it cannot
    be read: another system, or the process exited)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def release_freed() -> None:
    """Hand memory freed by an unload back to the system (glibc keeps it otherwise), so
    the next load's growth is measured against what is really resident."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
