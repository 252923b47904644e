"""A clean stop on the Ray runtime: SIGTERM (what Kubernetes, Docker and systemd send) to
``servekit serve --runtime ray`` drains the requests in flight, exits 0 and leaves no Ray
process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray", reason="needs the ray extra")
pytestmark = pytest.mark.own_ray  # servekit starts its own Ray

from conftest import free_port, wait_until
from servekit.client import Client
from servekit.errors import ModelNotReady, ServerUnreachable


def tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``SERVEKIT_TEST_TAG=tag`` (Ray's processes inherit
    the environment of the servekit that started them, so this finds every one)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"SERVEKIT_TEST_TAG={tag}".encode() in env.split(b"\0"):
            found.append(int(pid))
    return found


def test_sigterm_drains_requests_in_flight_exits_0_and_leaves_no_ray_process(add_sub_path):
    port, tag = free_port(), uuid.uuid4().hex
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "servekit", "serve", "--runtime", "ray", "--model",
         str(add_sub_path), "--name", "add_sub", "--host", "127.0.0.1", "--http-port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "SERVEKIT_TEST_TAG": tag},
    )  # fmt: skip
    calls: list[tuple[float, float, object]] = []  # (sent, answered, outcome)
    done = threading.Event()

    def client(k: int) -> None:
        x = np.full((1, 16), k, np.float32)
        with Client(url, timeout_s=30) as c:
            while not done.is_set():
                sent = time.monotonic()
                try:
                    out = c.infer("add_sub", {"INPUT0": x, "INPUT1": x})
                    outcome: object = bool(np.array_equal(out["OUTPUT0"], 2 * x))
                except Exception as exc:
                    outcome = exc
                    time.sleep(0.05)
                calls.append((sent, time.monotonic(), outcome))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    try:
        with Client(url) as c:
            wait_until(lambda: c.is_ready("add_sub"), "add_sub ready", 180,
                       alive=lambda: proc.poll() is None)  # fmt: skip
        for t in threads:
            t.start()
        wait_until(lambda: len(calls) >= 200, "200 answers", 60)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        stopped = time.monotonic() - signalled
    finally:
        done.set()
        for t in threads:
            t.join(60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0  # servekit's drain, not Ray's abort (134)
    assert stopped < 30
    before = [c for c in calls if c[0] < signalled]
    assert any(answered > signalled for _, answered, _ in before), "none was in flight"
    assert [o for _, _, o in before if o is not True] == []  # every one answered, and right
    after = [o for sent, _, o in calls if sent >= signalled]
    assert all(o is True or isinstance(o, ModelNotReady | ServerUnreachable) for o in after), {
        repr(o) for o in after if o is not True
    }
    wait_until(lambda: not tagged(tag), "every Ray process gone", 30)
