"""A clean stop at any moment on Ray: ``servekit serve --runtime ray`` told SIGTERM (as
Kubernetes sends it, whenever it likes) while Ray starts, while Serve starts and while it
serves exits 0 and leaves no process of its tree behind (Ray's agents included). "While
Ray starts" counts from when the command catches SIGTERM: before that, Python is still
importing servekit (0.8 s here, more on a starved host) and the default action ends it.

Ray's ``ray.init`` installs a SIGTERM handler of its own that aborts the process (exit
134, its DashboardAgent and RuntimeEnvAgent left running); servekit puts its own back."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port

pytest.importorskip("ray", reason="needs the ray extra")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.own_ray  # each servekit starts its own Ray

SERVEKIT = str(Path(sys.executable).with_name("servekit"))


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize(
    "when",
    ["starting+1", "starting+3", "ready+0.5", "ready+2", "ready+15"],
)
def test_sigterm_at_any_moment_exits_0_and_leaves_no_process(when, tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [SERVEKIT, "serve", "--runtime", "ray", "--model", "add_sub", "--http-port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # every process of the tree, also those started after the signal
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                seen.update(c.pid for c in root.children(recursive=True))
            except psutil.Error:
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        phase, _, delay = when.partition("+")
        if phase == "ready":
            deadline = time.monotonic() + 180
            while not ready(port):
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "not ready within 180 s"
                time.sleep(0.1)
        else:  # counted from when the command catches SIGTERM: before, Python is importing
            deadline = time.monotonic() + 60
            while not _catches_sigterm(proc.pid):
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "SIGTERM not caught within 60 s"
                time.sleep(0.02)
        time.sleep(float(delay))
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    watcher.join(5)
    text = (tmp_path / "serve.log").read_text()
    assert code == 0, text[-3000:]
    assert "SIGTERM received" not in text
    deadline = time.monotonic() + 30
    left = seen
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if psutil.pid_exists(pid) and _alive(pid)}
        time.sleep(0.2)
    assert not left, [_name(pid) for pid in left]


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (the kernel's SigCgt mask)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return str(pid)
