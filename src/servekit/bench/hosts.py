"""Hosts on one machine, for cluster tests and benchmarks: each its own network, PID and
mount namespaces, with one private address on a bridge that only this machine sees.

A host is as separate as Linux makes it without a VM: its own loopback and ports, its
own process table (``ray stop`` on it stops only its own Ray), reached by the others and
by this machine (the bridge's ``.1``, where clients run) over a veth link that can be cut.
Making hosts needs root and ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux):
``unavailable()`` says which is missing. Every host dies with ``close`` (its PID
namespace's init is killed, and with it every process in it), also after a failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["Host", "Hosts", "unavailable"]

_REAPER = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)
"""A host's init: it reaps the orphans ``ray start`` leaves (its daemons) and lives until
``close`` kills it, which ends every process on the host."""


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "making hosts (network namespaces) needs root"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"making hosts needs {', '.join(missing)} (apt-get install iproute2 util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Host:
    """One host: ``address`` on the bridge; ``command`` runs a command on it."""

    index: int
    name: str
    """The network namespace's name."""
    address: str
    link: str
    """The bridge side of its veth link (``cut`` and ``mend`` set it down and up)."""
    init: int
    """Its init's pid, as this machine sees it."""
    temp_dir: Path

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` to run on this host (its network, processes and ``/proc``)."""
        return ["nsenter", f"--target={self.init}", "--net", "--pid", "--mount", "--", *argv]

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(argv), **kwargs)  # type: ignore[call-overload]

    def signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        """Send ``sig`` to the program ``popen`` started (``nsenter`` runs it as its child,
        so that it lives in the host's PID namespace)."""
        os.kill(_child(proc.pid), sig)

    def run(
        self, argv: list[str], timeout_s: float = 120, env: dict[str, str] | None = None
    ) -> str:
        """Run ``argv`` here to its end; what it printed on stdout (an error shows both streams)."""
        done = subprocess.run(self.command(argv), capture_output=True, timeout=timeout_s, env=env)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).decode(errors="replace")[-4000:]
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {done.returncode}: {said}")
        return done.stdout.decode(errors="replace")

    def kill_all(self) -> None:
        """SIGKILL every process on this host but its init (those in its PID namespace)."""
        ns = os.readlink(f"/proc/{self.init}/ns/pid")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.init:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "pid") == ns:
                    os.kill(int(entry.name), signal.SIGKILL)

    def cut(self) -> None:
        """Take this host off the network (its link down): a cable pulled."""
        _ip("link", "set", self.link, "down")

    def mend(self) -> None:
        _ip("link", "set", self.link, "up")


class Hosts:
    """``count`` hosts on a private /24 (``10.X.Y.11`` and up; this machine is ``.1``)."""

    def __init__(self, count: int = 3, root: Path | None = None) -> None:
        why = unavailable()
        if why is not None:
            raise RuntimeError(why)
        self.count = count
        self.tag = secrets.token_hex(2)
        self.bridge = f"skb{self.tag}"
        self.subnet = _free_subnet()
        self.gateway = f"{self.subnet}.1"
        self.root = root or Path("/tmp") / f"servekit-hosts-{self.tag}"
        self.hosts: list[Host] = []
        self._inits: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Hosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def start(self) -> None:
        _reap_stale()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.count):
            name, link = f"sk{self.tag}h{i + 1}", f"skv{self.tag}{i + 1}"
            address = f"{self.subnet}.{11 + i}"
            _ip("netns", "add", name)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            _ip("link", "set", f"{link}p", "netns", name)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            for args in (
                ("link", "set", f"{link}p", "name", "eth0"),
                ("addr", "add", f"{address}/24", "dev", "eth0"),
                ("link", "set", "eth0", "up"),
                ("link", "set", "lo", "up"),
                ("route", "add", "default", "via", self.gateway),
            ):
                _ip("-n", name, *args)
            # If this process dies without ``close`` (SIGKILL, a test run cut short), the
            # kernel kills unshare (its parent-death signal), unshare's --kill-child kills
            # the host's init, and with it every process on the host.
            init = subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "--pid", "--kill-child", "--mount-proc",
                 sys.executable, "-c", _REAPER],
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
            self._inits.append(init)
            temp = self.root / f"h{i + 1}"
            temp.mkdir(parents=True, exist_ok=True)
            self.hosts.append(Host(i + 1, name, address, link, _child(init.pid), temp))

    def close(self) -> None:
        """Every host's processes killed, its namespace and link deleted, then the bridge."""
        for host in self.hosts:
            _kill(host.init)
        for init in self._inits:
            _kill(init.pid)
            init.wait(30)
        for i in range(self.count):
            subprocess.run(["ip", "netns", "del", f"sk{self.tag}h{i + 1}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"skv{self.tag}{i + 1}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        self.hosts, self._inits = [], []


def _free_subnet() -> str:
    """A random ``10.X.Y`` /24 that no route of this machine covers (so no real network's
    traffic is ever sent to the hosts, nor theirs to it)."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    taken = []
    for line in routes.splitlines():
        for word in line.split()[:2]:  # "10.0.0.0/8 via ..." or "blackhole 10.0.0.0/8"
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(word, strict=False))
    while True:
        subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250) + 1}"
        if not any(ipaddress.ip_network(f"{subnet}.0/24").overlaps(t) for t in taken):
            return subnet


def _reap_stale() -> None:
    """Delete what an earlier run that died left: its hosts' namespaces with no process
    left in them (their inits died with it), their links, and bridges with no host. (A
    ``Hosts`` starting at the same moment in another process could lose a namespace it
    has not yet put its init in: start one at a time.)"""
    ours = [n for n in _netns() if re.fullmatch(r"sk[0-9a-f]{4}h\d+", n)]
    for name in ours:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        if not pids.stdout.strip():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    live = {n[2:6] for n in ours if n in _netns()}
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        link = line.split(": ")[1].split("@")[0]
        match = re.fullmatch(r"sk[bv]([0-9a-f]{4})\d*", link)
        if match and match[1] not in live:
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def _netns() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it dies."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _child(pid: int, timeout_s: float = 10.0) -> int:
    """The one process ``pid`` forks (``unshare --fork``'s child: the host's init), waited for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            children = task.read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.02)
    raise RuntimeError(f"unshare (pid {pid}) started no init within {timeout_s:g} s")


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
