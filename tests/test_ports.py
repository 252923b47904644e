"""Every port a server opens is one the user named or one its startup line announces:
``servekit serve --port-base`` on the default runtime (PyTriton: servekit's front and
tritonserver behind it), on triton (tritonserver and its backend stubs behind the front)
and on native, checked against the sockets the server's whole
process tree listens on."""

from __future__ import annotations

import re
import subprocess
import sys
import time

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


def base_of_six() -> int:
    """A port N with N..N+5 all free now."""

    def free(port: int) -> bool:
        try:
            return free_port((port, port)) == port
        except OSError:  # taken, or handed to another process lately
            return False

    for _ in range(50):
        base = free_port()
        if all(free(p) for p in range(base + 1, base + 6)):
            return base
    pytest.skip("no six free ports in a row on this host")


@pytest.mark.parametrize(
    ("runtime", "opened"),
    [("pytriton", 6), ("triton", 6), ("native", 3)],
)
def test_serve_opens_only_the_ports_it_was_given_and_says_each(
    runtime, opened, add_sub_path, tmp_path
):
    if runtime in ("pytriton", "triton"):
        pytest.importorskip("pytriton", reason="needs the triton extra")
    base = base_of_six()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "servekit", "serve", "--runtime", runtime,
               "--model", str(add_sub_path), "--host", "127.0.0.1", "--port-base", str(base)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        from servekit.client import Client

        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with Client(f"http://127.0.0.1:{base}") as c:
                    if c.is_ready():
                        break
            except Exception:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        ports = listening(proc.pid)
        given = set(range(base, base + opened))
        assert ports == given, (sorted(ports), log.read_text()[-2000:])
        line = next(x for x in log.read_text().splitlines() if x.startswith("starting the"))
        assert {int(p) for p in re.findall(r"\b\d{4,5}\b", line)} >= given, line
    finally:
        proc.terminate()
        proc.wait(60)
