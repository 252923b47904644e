"""Every port a server opens is one the user named or one its startup line announces:
``servekit serve --port-base`` on the default runtime (PyTriton: servekit's front and
tritonserver behind it), on triton (tritonserver and its backend stubs behind the front),
on native, and on ray (the Ray servekit starts, on the block after servekit's own),
checked against the sockets the server's whole process tree listens on."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from servekit.endpoints import free_port, parse_port_range


def test_a_port_range_is_honoured_and_its_exhaustion_is_named():
    first = free_port()
    ports = {free_port((first, first + 9)) for _ in range(3)}
    assert len(ports) == 3 and all(first <= p <= first + 9 for p in ports)
    with pytest.raises(OSError, match=f"no free port left in {first}:{first}"):
        free_port((first, first))  # handed out already (or taken)
    assert parse_port_range("19000:19099") == (19000, 19099)
    for bad in ("19000", "5:4", "0:10", "a:b"):
        with pytest.raises(ValueError, match="FIRST:LAST"):
            parse_port_range(bad)


def test_the_ports_a_process_listens_on_are_read_from_proc_and_said_as_ranges():
    from servekit.endpoints import said_ports
    from servekit.runtime.processes import listening_ports

    with socket.socket() as served, socket.socket() as bound:
        served.bind(("127.0.0.1", 0))
        served.listen()
        bound.bind(("127.0.0.1", 0))  # bound, not listening
        found = listening_ports([os.getpid(), 2**22 + 1])  # past pid_max: no such process
        listens, only_bound = served.getsockname()[1], bound.getsockname()[1]
    assert listens in found[os.getpid()] and only_bound not in found[os.getpid()]
    assert list(found) == [os.getpid()]
    assert said_ports([9000, 8002, 8000, 8001, 8001]) == "8000-8002, 9000"


def listening(pid: int) -> set[int]:
    """TCP ports the process ``pid`` and all its children listen on."""
    ports = set()
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    ports.add(c.laddr.port)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ports


def base_of(count: int = 6) -> int:
    """A port N with N..N+count-1 all free now."""

    def free(port: int) -> bool:
        try:
            return free_port((port, port)) == port
        except OSError:  # taken, or handed to another process lately
            return False

    for _ in range(50):
        base = free_port()
        if all(free(p) for p in range(base + 1, base + count)):
            return base
    pytest.skip(f"no {count} free ports in a row on this host")


def serving(command: list[str], log: Path, url: str, timeout_s: float = 120) -> subprocess.Popen:
    """``command`` started with its output in ``log``, once ``url`` says it is ready."""
    from servekit.client import Client

    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(60)
            pytest.fail(f"not ready in {timeout_s} s: {log.read_text()[-3000:]}")
        try:
            with Client(url) as c:
                if c.is_ready():
                    return proc
        except Exception:
            pass
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("runtime", "opened"),
    [("pytriton", 6), ("triton", 6), ("native", 3)],
)
def test_serve_opens_only_the_ports_it_was_given_and_says_each(
    runtime, opened, add_sub_path, tmp_path
):
    if runtime in ("pytriton", "triton"):
        pytest.importorskip("pytriton", reason="needs the triton extra")
    base = base_of()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "servekit", "serve", "--runtime", runtime,
               "--model", str(add_sub_path), "--host", "127.0.0.1", "--port-base", str(base)]  # fmt: skip
    proc = serving(command, log, f"http://127.0.0.1:{base}")
    try:
        ports = listening(proc.pid)
        given = set(range(base, base + opened))
        assert ports == given, (sorted(ports), log.read_text()[-2000:])
        line = next(x for x in log.read_text().splitlines() if x.startswith("starting the"))
        assert {int(p) for p in re.findall(r"\b\d{4,5}\b", line)} >= given, line
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.own_ray
def test_ray_starts_on_the_block_after_servekit_s_ports_and_says_every_other_port(
    add_sub_path, tmp_path
):
    """``--runtime ray --port-base N``: HTTP N, then the Ray servekit starts from N+6 (its
    GCS, agents and worker processes); the one kind of port Ray has no setting for (each
    Serve replica's inter-deployment gRPC) is announced once started. Every process of
    the tree is gone after the stop."""
    from conftest import needs_runtime, wait_until
    from servekit.config.server import ray_port_count

    needs_runtime("ray")
    count = 6 + ray_port_count()
    base = base_of(count)
    block = set(range(base, base + count))
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "servekit", "serve", "--runtime", "ray",
               "--model", str(add_sub_path), "--host", "127.0.0.1", "--port-base", str(base)]  # fmt: skip
    proc = serving(command, log, f"http://127.0.0.1:{base}", timeout_s=180)
    tree = [proc.pid]
    try:
        tree += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        # Ready once the ingress answers; the line follows when serve.run returns.
        wait_until(lambda: "\nRay listens" in log.read_text(), "Ray's ports said", 30)
        ports = listening(proc.pid)
        lines = log.read_text().splitlines()
        start = next(x for x in lines if x.startswith("starting the"))
        assert f"HTTP {base}," in start and f"GCS {base + 6}," in start, start
        assert f"worker processes {base + 16}-{base + count - 1} " in start, start
        said = next(x for x in lines if x.startswith("Ray listens"))
        picked = {int(p): who for p, who in re.findall(r"\b(\d{4,5}) \(([^)]+)\)", said)}
        assert ports - block == set(picked), (sorted(ports - block), said)
        assert all(who.startswith("ray::ServeReplica") for who in picked.values()), said
        assert {base, base + 6} <= ports  # servekit's HTTP (Serve's proxy) and Ray's GCS
    finally:
        proc.terminate()
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    wait_until(lambda: not [p for p in tree if psutil.pid_exists(p)
                            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
               "every process of the tree gone", 30)  # fmt: skip
