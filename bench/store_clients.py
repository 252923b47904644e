"""The model store under concurrent clients, as issue 36 found it: a store of nine add_sub
models with 8 MB of weights and a tiny CNN, an on-demand budget, N tritonclient threads
for some seconds. Prints what was answered, refused and failed, how many loads ran, how
many more ran in the second after the clients stopped, the charges, and how long the stop
took. Runs against whatever servekit is importable (PYTHONPATH=<a checkout>/src for an
older one), with only the APIs every version of the store has.

    .venv/bin/python bench/store_clients.py --clients 4 --seconds 3 --budget-mb 64
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import tritonclient.http as httpclient

from servekit import ServeConfig, ServerConfig, zoo
from servekit.config import StoreConfig
from servekit.native import NativeServer
from servekit.zoo.tiny import build_add_sub


def folder(root: Path) -> None:
    onnx.save(build_add_sub(weights_mb=8), root / "folder0.onnx")
    for i in range(1, 9):
        shutil.copyfile(root / "folder0.onnx", root / f"folder{i}.onnx")
    (root / "cnn" / "1").mkdir(parents=True)
    shutil.copyfile(zoo.build("tiny_cnn", root / "cache"), root / "cnn" / "1" / "model.onnx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--budget-mb", type=float, default=64.0)
    parser.add_argument("--timeout-s", type=float, default=15.0, help="each client's deadline")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="store-clients-"))
    try:
        folder(root)
        store = StoreConfig(root=str(root), memory_budget_mb=args.budget_mb, load="on_demand")
        config = ServeConfig(
            (), ServerConfig(exit_timeout_s=5), runtime="native", store=store
        ).on_loopback()
        server = NativeServer(config).start()
        run(server, config, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(server: NativeServer, config: ServeConfig, args: argparse.Namespace) -> None:
    url = config.server.http_url.removeprefix("http://")
    outcomes: dict[str, int] = {"answered": 0, "refused (503)": 0, "failed": 0}
    worst = [0.0]
    stop_at = time.monotonic() + args.seconds
    names = sorted(server.store.known())

    def client(k: int) -> None:
        rng = random.Random(k)
        c = httpclient.InferenceServerClient(
            url, network_timeout=args.timeout_s, connection_timeout=args.timeout_s
        )
        while time.monotonic() < stop_at:
            name = rng.choice(names)
            started = time.monotonic()
            try:
                if name == "cnn":
                    x = np.zeros((1, 3, 32, 32), np.float32)
                    t = httpclient.InferInput("input", list(x.shape), "FP32")
                    t.set_data_from_numpy(x)
                    c.infer(name, [t])
                else:
                    x = np.ones((1, 16), np.float32)
                    ts = []
                    for n in ("INPUT0", "INPUT1"):
                        t = httpclient.InferInput(n, [1, 16], "FP32")
                        t.set_data_from_numpy(x)
                        ts.append(t)
                    got = c.infer(name, ts).as_numpy("OUTPUT0")
                    assert np.array_equal(got, 2 * x), got
                outcomes["answered"] += 1
            except Exception as exc:
                status = getattr(exc, "status", lambda: None)()
                outcomes["refused (503)" if status == "503" else "failed"] += 1
            worst[0] = max(worst[0], time.monotonic() - started)
        c.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    loads = server.store.totals()["loads"]
    time.sleep(1.0)
    after = server.store.totals()["loads"] - loads
    index = server.store.index()
    charges = sorted(r.get("resident_bytes", 0) / 2**20 for r in index if r.get("resident_bytes"))
    stuck = [r["name"] for r in index if r["state"] == "LOADING"]
    stopping = time.monotonic()
    server.stop()
    print(
        f"clients={args.clients} seconds={args.seconds} budget_mb={args.budget_mb}: "
        f"{outcomes} in {took:.1f} s, worst request {worst[0]:.2f} s; loads {loads:.0f}, "
        f"{after:.0f} more in the second after; resident charges MB "
        f"{[round(c, 1) for c in charges]}; LOADING after: {stuck}; "
        f"stop took {time.monotonic() - stopping:.1f} s"
    )


if __name__ == "__main__":
    main()
