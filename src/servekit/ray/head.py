"""``RayHead``: the Ray the ray runtime starts, on the ports the user chose (``[ray]
ports``): ``ray start --head --block`` with every port Ray takes a setting for, which
servekit's driver joins by address and which stops with the runtime (what it started,
nothing else).

``ray.init`` takes none of these ports; ``ray start`` takes them as flags (GCS, node
manager, object manager, metrics export, the dashboard agent's HTTP and gRPC, the
runtime-env agent, the client server, the worker processes') and Ray's autoscaler and
dashboard read their metrics ports from the environment (``AUTOSCALER_METRIC_PORT``,
``DASHBOARD_METRIC_PORT``). ``--block`` keeps the command as the parent of Ray's
processes, in servekit's process tree; a SIGTERM to it stops them all. It runs in a
session of its own, so a terminal's Ctrl-C reaches servekit, which drains first.

Ray's token authentication: a driver reads ``RAY_AUTH_MODE`` when Ray is imported, and
``ray.init`` given an address never turns it on (a Ray ``ray.init`` starts itself has it
on by default). So before Ray's import the head and this process get ``RAY_AUTH_MODE =
token`` (and a token of this run's in ``RAY_AUTH_TOKEN`` where none is set up), as
``ray.init`` would; a mode the user set is kept. Where Ray was imported before without a
mode, the driver cannot authenticate: the head then runs without (said in the log).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..config.server import RAY_PORTS
from ..runtime.processes import descendants, end_processes

__all__ = ["RayHead"]

log = logging.getLogger("servekit")

FLAGS = (
    "--port", "--node-manager-port", "--object-manager-port", "--metrics-export-port",
    "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
    "--ray-client-server-port",
)  # fmt: skip
"""``ray start``'s flag for each of the first ``RAY_PORTS``, in that order."""
ENVIRONMENT = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
"""The variables Ray reads the last two ``RAY_PORTS`` from."""
assert len(FLAGS) + len(ENVIRONMENT) == len(RAY_PORTS)

STARTED = "Ray runtime started."
"""What ``ray start`` prints once the head's processes are up."""
START_S = 180.0
STOP_S = 30.0


class RayHead:
    """``ray start --head --block`` on ``ports`` (``RAY_PORTS``' order, then the worker
    processes'): ``start`` returns the address to join, ``stop`` ends it."""

    def __init__(self, ports: tuple[int, ...], num_cpus: int | None = None) -> None:
        self.ports, self.num_cpus = ports, num_cpus
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None
        self._said_last = ""
        """The end of ``ray start``'s output, kept when it stops (its log is removed)."""
        self._env: dict[str, str] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def command(self) -> list[str]:
        named = [f"{flag}={port}" for flag, port in zip(FLAGS, self.ports, strict=False)]
        workers = ",".join(map(str, self.ports[len(RAY_PORTS) :]))
        cpus = [f"--num-cpus={self.num_cpus}"] if self.num_cpus is not None else []
        return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                "--include-dashboard=false", "--disable-usage-stats", *named,
                f"--worker-port-list={workers}", *cpus]  # fmt: skip

    def authenticate(self) -> None:
        """Choose Ray's authentication for the head and this process's driver; call it
        before Ray's first import here (the driver reads the mode then)."""
        if "RAY_AUTH_MODE" in os.environ:
            return
        if "ray._raylet" in sys.modules:
            log.warning("Ray was imported before servekit started its Ray: that Ray runs "
                        "without token authentication, as this process's driver does")  # fmt: skip
            self._env = {"RAY_AUTH_MODE": "disabled"}
            return
        os.environ["RAY_AUTH_MODE"] = "token"
        if not _has_token():  # one for this run, where ray.init would write ~/.ray/auth_token
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)

    def start(self, timeout_s: float = START_S) -> str:
        """Start the head and wait until its processes are up; returns its address.

        Raises:
            OSError: ``ray start`` exited (a port taken, say: its last words say which) or
                did not come up within ``timeout_s``.
        """
        metrics = self.ports[len(FLAGS) : len(RAY_PORTS)]
        env = {**os.environ, **self._env, **dict(zip(ENVIRONMENT, map(str, metrics), strict=True))}
        fd, name = tempfile.mkstemp(prefix="servekit-ray-start-", suffix=".log")
        self._log = Path(name)
        with os.fdopen(fd, "wb") as out:
            proc = self._proc = subprocess.Popen(
                self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while STARTED not in self._said():
            code = proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with {code}" if code is not None else f"not up in {timeout_s:g} s"
                raise OSError(f"ray start {why}: {self._said_last}")
            time.sleep(0.1)
        return self.address

    def stop(self, timeout_s: float = STOP_S) -> None:
        """SIGTERM ``ray start`` (it stops every process of its Ray), then end any of them
        still running after ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is not None:
            below = descendants(proc.pid)
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            left = [pid for pid, argv in below.items() if _argv(pid) == argv]
            if left:
                log.warning("stopping %d of Ray's processes left after its stop", len(left))
                end_processes(left)
        if self._log is not None:
            self._said_last = self._said()[-2000:]
            self._log.unlink(missing_ok=True)
            self._log = None

    def _said(self) -> str:
        try:
            return self._log.read_text(errors="replace") if self._log is not None else ""
        except OSError:
            return ""


def _has_token() -> bool:
    """Whether Ray finds a token where it looks (its variables, ``~/.ray/auth_token``)."""
    return bool(
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (Path.home() / ".ray" / "auth_token").is_file()
    )


def _argv(pid: int) -> list[str] | None:
    """The argv of process ``pid`` as ``descendants`` reads it (None: gone, or a zombie)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, IndexError):
        return None
