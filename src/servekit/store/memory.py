"""The process's resident memory, as the budget charges it: host RSS plus, where a GPU
exists, the device memory NVML accounts to this process."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

__all__ = ["device_bytes", "release_freed", "resident_bytes", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size in bytes (Linux ``/proc/<pid>/statm``; 0 where it cannot
    be read: another system, or the process exited)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_nvml: list[Any] = []
"""[pynvml, device handles] once NVML answered; [None, []] where it cannot (no library,
driver or GPU)."""


def _devices() -> tuple[Any, list[Any]]:
    if not _nvml:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            _nvml.extend([pynvml, handles])
        except Exception:  # no nvidia-ml-py, no driver, no GPU
            _nvml.extend([None, []])
    return _nvml[0], _nvml[1]


def device_bytes(pid: int | None = None) -> int:
    """GPU memory held by process ``pid`` (default: this one) on every device, as NVML
    accounts it; 0 where there is no GPU (or NVML cannot see the process's usage)."""
    nvml, handles = _devices()
    pid = os.getpid() if pid is None else pid
    total = 0
    for handle in handles:
        try:
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            continue
        total += sum(p.usedGpuMemory or 0 for p in processes if p.pid == pid)
    return total


def resident_bytes() -> int:
    """What a load is charged from: host RSS plus this process's device memory."""
    return rss_bytes() + device_bytes()


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
