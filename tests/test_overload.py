"""Sustained overload: a full queue rejects at once (503 + Retry-After), answers stay right,
and the server's memory stays flat while it is kept over capacity.

The server is its own process (servekit's KServe front and Batcher on uvicorn, a model
that takes 20 ms a batch, a queue of 8), so its resident memory is measured apart from
the 64 clients that keep it saturated.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("uvicorn", reason="needs uvicorn (http extra)")

from conftest import free_port, wait_until
from servekit import Overloaded
from servekit.client import AsyncClient
from servekit.store import rss_bytes

SERVER = """
import sys, time
import numpy as np
from servekit import Batcher, BatchingPolicy, FunctionRunner, ModelSpec, TensorSpec
from servekit.batching import QueuePolicy
from servekit.http import KServeApp, serve_http

spec = ModelSpec((TensorSpec("x", np.float32, [256]),), (TensorSpec("y", np.float32, [256]),), 4)

def slow(d):
    time.sleep(0.02)
    return {"y": d["x"] * 2}

policy = BatchingPolicy(max_batch_size=4, default_queue_policy=QueuePolicy(max_queue_size=8))
serve_http(KServeApp({"m": Batcher(FunctionRunner(slow, spec), policy, name="m")}),
           host="127.0.0.1", port=int(sys.argv[1]))
"""


def rss_mb(pid: int) -> float:
    rss = rss_bytes(pid)
    assert rss, f"no RSS for process {pid}"
    return rss / 2**20


async def saturate(url: str, seconds: float, clients: int = 64) -> dict[str, int]:
    counts = {"ok": 0, "rejected": 0, "wrong": 0}
    stop = time.monotonic() + seconds
    client = AsyncClient(url, timeout_s=30)

    async def one(i: int) -> None:
        x = np.full((1, 256), float(i), np.float32)
        while time.monotonic() < stop:
            try:
                y = (await client.infer("m", {"x": x}))["y"]
            except Overloaded:
                counts["rejected"] += 1
                await asyncio.sleep(0.005)
                continue
            counts["ok" if np.array_equal(y, x * 2) else "wrong"] += 1

    try:
        await asyncio.gather(*(one(i) for i in range(clients)))
    finally:
        await client.close()
    return counts


@pytest.mark.timeout(180)
def test_memory_stays_flat_while_the_server_is_kept_over_capacity(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2),
            "the server ready", 60, alive=lambda: proc.poll() is None,
        )  # fmt: skip
        warm = asyncio.run(saturate(url, 6))
        before = rss_mb(proc.pid)
        rounds = [asyncio.run(saturate(url, 6)) for _ in range(3)]
        after = rss_mb(proc.pid)
        print(f"rounds {[warm, *rounds]}, resident {before:.1f} -> {after:.1f} MB")
        for counts in (warm, *rounds):
            assert counts["wrong"] == 0
            assert counts["ok"] > 50, counts  # the model kept working through the overload
            assert counts["rejected"] > counts["ok"], counts  # 64 callers, 8 queue slots
        # Three more rounds of thousands of rejected requests each: no growth beyond noise.
        assert after - before < 8, f"resident memory {before:.1f} -> {after:.1f} MB"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
