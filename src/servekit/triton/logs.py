"""tritonserver's log, followed and filtered for the console.

tritonserver 2.51 prints lines at every start that read like failures but are not: an
error per model PyTriton loads from memory (``Failed to set config modification time``)
and, on a machine without a GPU, CUDA's pinned-memory and driver messages. Each known
one is explained once and then hidden; the start-up tables are dropped; every other
warning and error is passed on as it is. With ``log_verbose`` > 0 nothing is filtered.

``Workdir`` is the folder a tritonserver runs from: its log, its processes (found by
their executable's path under it) and its Python backend stubs' shared memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from pathlib import Path

__all__ = ["HARMLESS", "LogFollower", "Workdir", "filter_line"]

log = logging.getLogger("servekit.tritonserver")

HARMLESS = {
    "Failed to set config modification time": (
        "tritonserver 2.51 logs 'Failed to set config modification time' for every model "
        "loaded with its config in the request (all of PyTriton's): harmless"
    ),
    "Unable to allocate pinned system memory": "no CUDA driver: no pinned memory pool (CPU serving)",
    "CudaDriverHelper has not been initialized": "no CUDA driver: CPU serving",
    "CUDA memory pool disabled": "no CUDA driver: CPU serving",
}
"""Substring -> why the line is harmless."""

_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ?(.*)$")
_FATAL = re.compile(
    r"terminate called|^\s*what\(\):|^Signal \((?!2\)|15\))\d+\) received|core dumped"
)
"""A crash's own lines (a C++ abort, the signal handler's report of any signal but a
stop's SIGINT or SIGTERM): not in Triton's format, errors all the same."""


def filter_line(line: str, explained: set[str]) -> tuple[int, str] | None:
    """What to log for one tritonserver line: (level, text), or None to hide it.
    ``explained`` collects the explanations already given."""
    stripped = line.rstrip("\n")
    for needle, why in HARMLESS.items():
        if needle in stripped:
            if why in explained:
                return None
            explained.add(why)
            return logging.INFO, f"tritonserver: {why} (hidden from now on)"
    if not stripped.strip() or stripped.lstrip()[:1] in ("+", "|"):
        return None  # the start-up tables
    m = _LINE.match(stripped)
    if m is None:
        level = logging.ERROR if _FATAL.search(stripped) else logging.INFO
        return level, f"tritonserver: {stripped}"
    kind, text = m.groups()
    if not text.strip():
        return None  # a table's heading line
    level = {"I": logging.INFO, "W": logging.WARNING}.get(kind, logging.ERROR)
    text = text.strip().strip('"')
    return level, f"tritonserver: {text}"


class LogFollower:
    """Follows a growing log file on a daemon thread and logs its lines, filtered."""

    def __init__(self, path: Path, *, verbose: bool = False, interval_s: float = 0.2) -> None:
        self.path, self.verbose, self.interval_s = Path(path), verbose, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._explained: set[str] = set()

    def start(self) -> LogFollower:
        self._thread = threading.Thread(target=self._run, name="servekit-tritonlog", daemon=True)
        self._thread.start()
        return self

    def _emit(self, line: str) -> None:
        if self.verbose:
            log.info("tritonserver: %s", line.rstrip("\n"))
            return
        out = filter_line(line, self._explained)
        if out is not None:
            log.log(*out)

    def _run(self) -> None:
        while not self.path.exists():
            if self._stop.wait(self.interval_s):
                return
        with self.path.open(errors="replace") as f:
            pending = ""
            while True:
                chunk = f.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        self._emit(pending)
                        pending = ""
                    continue
                if self._stop.is_set():
                    if pending:
                        self._emit(pending)
                    return
                time.sleep(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class Workdir:
    """A tritonserver's private folder: its log (followed to the console, filtered) and its
    processes (found by their executable's path under it). ``close`` stops following,
    kills what outlived the server there, frees its stubs' shared memory and load folders,
    and removes the folder."""

    def __init__(self, prefix: str, *, verbose: bool = False) -> None:
        import tempfile

        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self.region_prefix = f"servekit_{self.path.name.rsplit('-', 1)[-1]}_"
        """The name every stub region of a tritonserver told it begins with (the Python
        backend's ``shm-region-prefix-name``): ``close`` frees each, however late it was
        made (a stub a crashed tritonserver was starting)."""
        self.log_path = self.path / "tritonserver.log"
        self._follower = LogFollower(self.log_path, verbose=verbose).start()
        self._regions: set[str] = set()
        self._loaded: set[Path] = set()

    def stubs(self, server: int | None = None) -> dict[int, list[str]]:
        """The Python backend stubs running here now: pid -> argv. Each one's shared memory
        region (its argv[2]) and the folder its model was loaded into (argv[1], when
        tritonserver made one) are remembered, for ``close`` to free; so are the regions
        their tritonserver (``server``, and each stub's parent) maps, which include that of
        a stub it is still starting (a replacement for a dead one, say)."""
        from ..runtime.processes import processes

        found = {
            pid: argv
            for pid, argv in processes(str(self.path)).items()
            if argv[0].endswith("triton_python_backend_stub")
        }
        self._regions.update(
            argv[2].lstrip("/")
            for argv in found.values()
            if len(argv) > 2 and _REGION.match(argv[2])
        )
        parents = {_parent(pid) for pid in found}
        servers = {pid for pid in parents if pid is not None and _is_tritonserver(pid)}
        for pid in servers | ({server} if server is not None else set()):
            self._regions.update(_mapped_regions(pid))
        for argv in found.values():
            loaded = _LOADED.match(argv[1]) if len(argv) > 1 else None
            if loaded:
                self._loaded.add(Path(loaded.group(1)))
        return found

    def kill_leftovers(self) -> int:
        """SIGKILL what runs here (``runtime.processes.kill_leftovers``), having noted the
        stubs' regions first."""
        from ..runtime.processes import kill_leftovers

        self.stubs()
        return kill_leftovers(str(self.path))

    def close(self) -> None:
        """Stop following the log, kill what outlived the server, and free what the stubs
        seen here held: their shared memory regions and the folders tritonserver copied
        their models into. tritonserver frees both only when it exits cleanly, so each kill
        or crash (and each restart after one) would leave them in /dev/shm, which a pod's
        memory-backed volume bounds, and in /tmp."""
        import shutil

        self._follower.stop()  # after the server's last words
        self.kill_leftovers()
        for name in self._regions:
            try:
                os.unlink(Path("/dev/shm") / name)
            except FileNotFoundError:  # freed by tritonserver's clean exit
                pass
            except OSError as exc:
                logging.getLogger("servekit").warning(
                    "could not free the shared memory region %s: %s", name, exc
                )
        self._regions.clear()
        for region in Path("/dev/shm").glob(f"{self.region_prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
        for folder in self._loaded:
            shutil.rmtree(folder, ignore_errors=True)  # absent after a clean exit
        self._loaded.clear()
        shutil.rmtree(self.path, ignore_errors=True)


_REGION = re.compile(r"^/?\w[\w.-]*$")
"""A Python backend stub's shared memory region as its argv names it: tritonserver's
``triton_<backend>_backend_shm_region_<uuid>``, PyTriton's ``pytrtion<pid>-<hash>-<uuid>``
(one name in /dev/shm, never a path)."""

_STUB_REGION = re.compile(r"^(triton_\w+_backend_shm_region_|pytrtion)[\w.-]+$")
"""The names the Python backend and PyTriton give a stub's region, as tritonserver maps it."""

_LOADED = re.compile(r"^(/tmp/folder[A-Za-z0-9]{6})/\d+/")
"""A stub's model file in the folder tritonserver makes (``mkdtemp`` of /tmp/folderXXXXXX)
for a model loaded with its files in the load request, as PyTriton loads its models."""


def _parent(pid: int) -> int | None:
    """``pid``'s parent (None once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _is_tritonserver(pid: int) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return argv0.endswith(b"/tritonserver")


def _mapped_regions(pid: int) -> set[str]:
    """The Python backend's regions (names in /dev/shm) process ``pid`` maps now; never a
    client's registered system shared memory, which tritonserver maps too."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    names = set()
    for line in lines:  # address, perms, offset, device, inode[, path]
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
            name = path[len("/dev/shm/") :]
            if _STUB_REGION.match(name):
                names.add(name)
    return names
