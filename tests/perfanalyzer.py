"""NVIDIA's perf_analyzer, the C++ binary in tritonclient 2.41.0's wheel, fetched into a
cache and run as a client of a real server. It needs Debian's ``libb64-0d`` and
``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12`` wheel; no GPU is used for
``--shared-memory system``); each comes where its registry serves it, else the test skips
naming what it could not get."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

WHEELS = ("tritonclient==2.41.0", "nvidia-cuda-runtime-cu12==12.9.79")
"""perf_analyzer's release (the tritonclient the triton extra pins) and a CUDA 12 runtime."""
BINARY = "tritonclient-2.41.0.data/data/bin/perf_analyzer"
LIBB64 = "libb64-0d"


@dataclass(frozen=True)
class PerfAnalyzer:
    """The binary and the environment it loads its libraries with."""

    binary: Path
    env: dict[str, str]


def fetch(cache: Path) -> PerfAnalyzer:
    """perf_analyzer unpacked under ``cache`` (fetched once: the wheels from PyPI, then
    ``libb64-0d`` with ``apt-get download`` where the system has none); skips naming what
    the registry or apt refused."""
    binary = cache / BINARY
    cudart = cache / "nvidia" / "cuda_runtime" / "lib"
    if not binary.exists() or not (cudart / "libcudart.so.12").exists():
        _unpack_wheels(cache)
    libs = [str(cudart)]
    if _loads(binary, libs) is not None:
        libs.append(str(_libb64(cache)))
    missing = _loads(binary, libs)
    if missing is not None:
        pytest.skip(f"perf_analyzer does not load: {missing}")
    return PerfAnalyzer(binary, _environment(libs))


def _environment(libs: list[str]) -> dict[str, str]:
    """This process's environment with ``libs`` first on the loader's path."""
    given = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([*libs, *([given] if given else [])])}


def _unpack_wheels(cache: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *WHEELS]
        got = subprocess.run(pip, capture_output=True, text=True, timeout=300)
        if got.returncode != 0:
            said = got.stderr.strip().splitlines()[-1:] or ["no words"]
            pytest.skip(f"pip download {' '.join(WHEELS)} refused: {said[0][:400]}")
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                wanted = [n for n in z.namelist() if n == BINARY or "/lib/libcudart.so" in n]
                z.extractall(cache, wanted)
    (cache / BINARY).chmod(0o755)


def _libb64(cache: Path) -> Path:
    """The folder holding ``libb64.so.0d``, unpacked from Debian's package into ``cache``
    (``apt-get download`` needs no root; the package lists are refreshed first where
    they lack it and this is root)."""
    where = cache / "libb64" / "usr" / "lib" / "x86_64-linux-gnu"
    if (where / "libb64.so.0d").exists():
        return where
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip(f"perf_analyzer needs {LIBB64} (Debian's): no apt-get here")
    debs = cache / "debs"
    debs.mkdir(exist_ok=True)
    download = ["apt-get", "download", "-q", LIBB64]
    got = subprocess.run(download, cwd=debs, capture_output=True, text=True, timeout=300)
    if got.returncode != 0 and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
        got = subprocess.run(download, cwd=debs, capture_output=True, text=True, timeout=300)
    deb = sorted(debs.glob(f"{LIBB64}_*.deb"))
    if got.returncode != 0 or not deb:
        said = got.stderr.strip().splitlines()[-1:] or ["no words"]
        pytest.skip(f"apt-get download {LIBB64} refused: {said[0][:400]}")
    subprocess.run(["dpkg-deb", "-x", str(deb[-1]), str(cache / "libb64")], check=True)
    return where


def _loads(binary: Path, libs: list[str]) -> str | None:
    """None if the binary's libraries all load, else the loader's words."""
    got = subprocess.run(
        [binary, "--version"], env=_environment(libs), capture_output=True, text=True
    )
    said = got.stdout + got.stderr
    return said.strip()[-400:] if "error while loading shared libraries" in said else None


@dataclass(frozen=True)
class Case:
    """One perf_analyzer run: its protocol, its model and the options that differ."""

    name: str
    protocol: str
    model: str
    options: tuple[str, ...]
    batch: int = 1


@dataclass(frozen=True)
class Run:
    """What a run printed, and the responses it received (one per request, as printed by
    its C++ client's verbose mode)."""

    output: str
    returncode: int
    responses: int


RESPONSE = {"http": b"inference response: ", "grpc": b'model_name: "'}
"""What the C++ client's verbose mode prints for each infer answer: HTTP, before its JSON
header; gRPC, the ModelInferResponse's first field (on a stream too, inside the
ModelStreamInferResponse); statistics answers print ``name`` instead. Counted anywhere in
the output: the client's threads write to it at once, so an answer's words may start
inside another's line."""


def run(pa: PerfAnalyzer, case: Case, url: str, timeout_s: float = 60) -> Run:
    """``case`` against the server at ``url`` (``host:port`` of its protocol): three
    windows of 300 ms whose spread is taken as stable up to 10x (the test checks
    correctness, not speed), inputs of zeros (so no answer's bytes spell an error)."""
    command = [
        str(pa.binary), "-m", case.model, "-u", url, "-i", case.protocol,
        "-b", str(case.batch), "-p", "300", "-s", "1000", "--input-data", "zero",
        "-v", "-v", *case.options,
    ]  # fmt: skip
    got = subprocess.run(command, env=pa.env, capture_output=True, timeout=timeout_s)
    output = got.stdout + got.stderr
    responses = output.count(RESPONSE[case.protocol])
    text = output.decode("utf-8", "replace")
    return Run(_summary(text), got.returncode, responses)


ERRORS = re.compile(r"error|fail|unable", re.IGNORECASE)
DUMPED = re.compile(r"^\s+fail \{$|^\s+fail \{\s*\}$")
"""A statistics answer's ``fail { ... }`` member, as the verbose client prints it."""
REPORT = re.compile(r"(Request|Inference|Execution) count|throughput|Request (concurrency|Rate)")


def errors(run: Run) -> list[str]:
    """The lines of a run's output that report a failure (perf_analyzer writes
    ``Thread [0] had error: ...``, ``Failed to ...``, ``Unable to ...``)."""
    return [line for line in run.output.splitlines() if ERRORS.search(line)]


def _summary(text: str) -> str:
    """perf_analyzer's own lines: its failures and its report, without the verbose
    client's dump of every answer."""
    lines = (line for line in text.splitlines() if len(line) < 400 and not DUMPED.match(line))
    return "\n".join(line for line in lines if ERRORS.search(line) or REPORT.search(line))


def inference_count(http_url: str, model: str) -> int:
    """The model's ``inference_count`` in the server's statistics (every version)."""
    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.loads(r.read())
    return sum(int(s.get("inference_count", 0)) for s in stats["model_stats"])
