"""A bounded soak run on loopback: steady load, bursts over capacity, bad requests and faults.

    python bench/soak.py --runtime triton   --seconds 90 --out bench/results/soak_triton.json
    python bench/soak.py --runtime pytriton --seconds 90 --out bench/results/soak_pytriton.json
    python bench/soak.py --runtime ray      --seconds 90 --out bench/results/soak_ray.json

The server runs in its own process tree (``servekit triton`` on a poll-mode repository,
``servekit serve``, ``servekit serve --runtime ray``; the first two behind servekit's
KServe front, their default), serving the zoo's tiny_cnn with a bounded queue
(max_queue_size 16). Against it, over HTTP:

- steady: 4 workers send one of 16 fixed inputs each and check the logits against
  ONNX Runtime in this process, for version 1 (seed 0) and version 2 (seed 1): an answer
  that is neither is *wrong*;
- bursts: every 15 s, 64 more workers for 3 s, over capacity (503s are expected then);
- bad requests: 2 per second, alternately the wrong dtype and the huge-shape JSON that
  aborts tritonserver 2.51 on its own port (400s are expected);
- a live update to version 2 at 30 % of the run and a rollback to version 1 at 45 %
  (triton: a version folder added, then removed, poll mode; pytriton and ray: the model
  file replaced, then SIGHUP);
- a killed worker at 60 %: SIGKILL to tritonserver (servekit's supervisor restarts it;
  the front answers 503 meanwhile), to the model's Python backend stub (pytriton), or to
  the model's Ray replica (Serve replaces it).

Every request ends in one class: ok, wrong, 4xx, 503, other failure, or lost (no
answer within 30 s). Peak resident memory of the server's process tree is sampled
every 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from servekit import BatchingPolicy, OnnxRuntimeRunner, QueuePolicy
from servekit.endpoints import free_port
from servekit.triton.repo import build_repository, runner_model
from servekit.zoo.tiny import build_tiny_cnn

QUEUE = 16


def start_server(runtime: str, workdir: Path, port: int) -> subprocess.Popen:
    model = workdir / "tiny.onnx"
    model.write_bytes(build_tiny_cnn(seed=0).SerializeToString())
    common = ["--host", "127.0.0.1", "--http-port", str(port)]
    if runtime == "triton":
        policy = BatchingPolicy(
            max_batch_size=8, default_queue_policy=QueuePolicy(max_queue_size=QUEUE)
        )
        build_repository(workdir / "repo", [runner_model("tiny", model, policy)])
        cmd = ["triton", "--model-repository", str(workdir / "repo"), "--model-control-mode", "poll",
               "--repository-poll-secs", "1", "--grpc-port", str(free_port()),
               "--metrics-port", str(free_port()), *common]  # fmt: skip
    else:
        cmd = ["serve", "--model", str(model), "--name", "tiny", "--max-batch-size", "8",
               "--max-queue-size", str(QUEUE), "--grpc-port", str(free_port()),
               "--metrics-port", str(free_port()), *common]  # fmt: skip
        if runtime == "ray":
            cmd += ["--runtime", "ray"]
    log = (workdir / "server.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "servekit", *cmd], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def body(x: np.ndarray, dtype: str = "FP32") -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": dtype,
                    "shape": list(x.shape),
                    "data": x.reshape(-1).tolist(),
                }
            ]
        }
    ).encode()


HOSTILE = json.dumps(
    {"inputs": [{"name": "input", "datatype": "FP32", "shape": [10**8, 3, 32, 32], "data": [0.0]}]}
).encode()


def replace(path: Path, data: bytes) -> None:
    """Write next to ``path`` and rename over it, so the server never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(16)]
    versions = [build_tiny_cnn(seed=s).SerializeToString() for s in (0, 1)]
    expected = []
    for data in versions:
        with OnnxRuntimeRunner(data) as local:
            expected.append([local.infer({"input": x})["logits"] for x in inputs])
    bodies = [body(x) for x in inputs]
    bad = [body(inputs[0].astype(np.float64), "FP64"), HOSTILE]

    workdir = Path(tempfile.mkdtemp(prefix="servekit-soak-"))
    port = free_port()
    server = start_server(args.runtime, workdir, port)
    url = f"http://127.0.0.1:{port}"
    counts: Counter[str] = Counter()
    by_phase: Counter[str] = Counter()
    peak = 0
    events: list[str] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        deadline = time.monotonic() + 180
        while True:  # ready
            try:
                async with session.get(f"{url}/v2/models/tiny/ready") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not come up; see {workdir / 'server.log'}")
            await asyncio.sleep(0.5)

        start = time.monotonic()
        end = start + args.seconds
        failures: list[float] = []
        unavailable: list[float] = []  # 503s outside the bursts
        answered_by: Counter[str] = Counter()
        burst = asyncio.Event()

        async def one(i: int, phase: str) -> None:
            try:
                async with session.post(f"{url}/v2/models/tiny/infer", data=bodies[i]) as r:
                    payload = await r.read()
                    if r.status == 200:
                        got = np.array(json.loads(payload)["outputs"][0]["data"], np.float32)
                        match = [
                            np.allclose(got.reshape(e[i].shape), e[i], rtol=1e-4, atol=1e-4)
                            for e in expected
                        ]
                        key = "ok" if any(match) else "wrong"
                        if any(match):
                            answered_by[f"v{match.index(True) + 1}"] += 1
                    elif r.status == 503:
                        key = "503"
                        if phase == "steady":
                            unavailable.append(time.monotonic() - start)
                    elif 400 <= r.status < 500:
                        key = "4xx"
                    else:
                        key = "other"
            except TimeoutError:
                key = "lost"
            except aiohttp.ClientError:
                key = "other"
            counts[key] += 1
            by_phase[f"{phase}:{key}"] += 1
            if key == "other":
                failures.append(time.monotonic() - start)
                await asyncio.sleep(0.1)  # back off as a client would while the server is down

        async def steady(w: int) -> None:
            i = w
            while time.monotonic() < end:
                await one(i % 16, "burst" if burst.is_set() else "steady")
                i += 1

        async def bursts() -> None:
            while time.monotonic() < end:
                await asyncio.sleep(12)
                if time.monotonic() + 3 > end:
                    return
                burst.set()
                stop = time.monotonic() + 3
                events.append(f"{time.monotonic() - start:.0f}s burst of 64 for 3 s")

                async def worker(w: int, stop: float = stop) -> None:
                    i = w
                    while time.monotonic() < stop:
                        await one(i % 16, "burst")
                        i += 1

                await asyncio.gather(*(worker(w) for w in range(64)))
                burst.clear()

        async def bad_requests() -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                try:
                    async with session.post(f"{url}/v2/models/tiny/infer", data=bad[n % 2]) as r:
                        await r.read()
                        key = "bad:4xx" if 400 <= r.status < 500 else f"bad:{r.status}"
                except aiohttp.ClientError:
                    key = "bad:other"
                by_phase[key] += 1
                await asyncio.sleep(0.5)

        def note(event: str) -> None:
            events.append(f"{time.monotonic() - start:.0f}s {event}")

        async def update(to: int) -> None:
            """Version ``to`` (1 or 2) goes live the runtime's way."""
            if args.runtime == "triton":
                folder = workdir / "repo" / "tiny" / "2"
                if to == 2:
                    tmp = workdir / "repo" / ".tiny-2"
                    tmp.mkdir()
                    (tmp / "model.onnx").write_bytes(versions[1])
                    tmp.rename(folder)
                    note("version 2 folder added")
                else:
                    shutil.rmtree(folder)
                    note("version 2 folder removed (rollback to 1)")
            else:
                replace(workdir / "tiny.onnx", versions[to - 1])
                server.send_signal(signal.SIGHUP)
                note(f"model file is version {to}, SIGHUP")

        def kill_worker() -> None:
            """SIGKILL the process that runs the model."""

            def cmdline(p: psutil.Process) -> str:
                with contextlib.suppress(psutil.Error):
                    return " ".join(p.cmdline())
                return ""

            procs = sorted(
                psutil.Process(server.pid).children(recursive=True), key=lambda p: p.create_time()
            )
            marker = {  # PyTriton loads tiny first, so its stub is the oldest
                "triton": "bin/tritonserver",
                "pytriton": "triton_python_backend_stub",
                "ray": "ServeReplica:servekit:Model",
            }[args.runtime]
            victim = next((p for p in procs if marker in cmdline(p)), None)
            if victim is None:
                note("no worker process found to kill")
                return
            os.kill(victim.pid, signal.SIGKILL)
            note(f"SIGKILL {marker} (pid {victim.pid})")

        async def faults() -> None:
            await asyncio.sleep(args.seconds * 0.3)
            await update(2)
            await asyncio.sleep(args.seconds * 0.15)
            await update(1)
            await asyncio.sleep(args.seconds * 0.15)
            kill_worker()

        async def memory() -> None:
            nonlocal peak
            while time.monotonic() < end:
                peak = max(peak, tree_rss(server.pid))
                await asyncio.sleep(0.5)

        await asyncio.gather(
            *(steady(w) for w in range(4)), bursts(), bad_requests(), faults(), memory()
        )
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    sent = sum(counts.values())
    return {
        "runtime": args.runtime,
        "seconds": args.seconds,
        "sent": sent,
        "ok": counts["ok"],
        "wrong": counts["wrong"],
        "rejected_503": counts["503"],
        "rejected_4xx": counts["4xx"],
        "failed_other": counts["other"],
        "lost": counts["lost"],
        "by_phase": dict(sorted(by_phase.items())),
        "failure_windows_s": _windows(failures),
        "steady_503_windows_s": _windows(unavailable),
        "answered_by_version": dict(sorted(answered_by.items())),
        "events": events,
        "peak_rss_mb": round(peak / 2**20, 1),
        "server_exit_code": server.returncode,
        "log": str(workdir / "server.log"),
    }


def _windows(times: list[float], gap: float = 2.0) -> list[list[float]]:
    """[start, end] seconds of each run of failures (failures closer than ``gap`` s)."""
    out: list[list[float]] = []
    for t in sorted(times):
        if out and t - out[-1][1] <= gap:
            out[-1][1] = round(t, 1)
        else:
            out.append([round(t, 1), round(t, 1)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", choices=["triton", "pytriton", "ray"], default="triton")
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
