"""Many models on shared hardware (issue: the model store): 100 models in a folder, a
memory budget that holds about ten, requests from a client over loopback.

Measured on each server, sequentially from one client (tritonclient HTTP):
- cold: the first request to a model not loaded (load, warm-up and the answer), with room
  in the budget;
- evicting: the same once the budget is full (an eviction first);
- warm: a request to a resident model;
- working set: each model of a set touched once, then four client threads sending to
  random models of it: a set of 10 (it fits) and of 30 (it does not: loads and evictions
  all along), requests/s and p50/p99.

Servers: servekit native with ``[store] load = "on_demand"`` (loads on a request);
Triton's explicit model control driven by the client as a Triton user must (on "not
ready", load the model; past 10 loaded, unload the one it used least recently), on
servekit's Triton backend with the same files; and a plain Ray Serve app with
``@serve.multiplexed(max_num_models_per_replica=10)`` (bench/plain_ray_multiplex.py).

    python bench/store.py --out bench/results/store
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from servekit import BatchingPolicy, ServeConfig, ServerConfig
from servekit.bench.compare import ServerProcess, spawned
from servekit.bench.report import machine as report_machine
from servekit.config import StoreConfig
from servekit.endpoints import free_port
from servekit.protocol.pbtxt import model_config, render
from servekit.runners import load_runner
from servekit.triton.launcher import TritonOptions, TritonProcess
from servekit.zoo.tiny import build_add_sub

MODELS = 100
TOKEN = "bench"
HEADERS = {"servekit-control-token": TOKEN}


def build_folder(root: Path, weights_mb: float) -> None:
    """``add_<i>.onnx`` and the same as a Triton repository (``triton/add_<i>/1/model.onnx``)."""
    onnx.save(build_add_sub(weights_mb=weights_mb), root / "add_0.onnx")
    spec = load_runner(root / "add_0.onnx").spec
    for i in range(MODELS):
        name = f"add_{i}"
        if i:
            shutil.copyfile(root / "add_0.onnx", root / f"{name}.onnx")
        version = root / "triton" / name / "1"
        version.mkdir(parents=True)
        shutil.copyfile(root / "add_0.onnx", version / "model.onnx")
        config = model_config(
            name, spec, BatchingPolicy(max_batch_size=8), parameters={"kind": "runner"}
        )
        (root / "triton" / name / "config.pbtxt").write_text(render(config))


class Native:
    """servekit: a request loads its model; the store evicts."""

    def __init__(self, url: str) -> None:
        self.url = url

    def client(self) -> Callable[[str], None]:
        c = httpclient.InferenceServerClient(self.url)
        return lambda name: infer(c, name)


class TritonExplicit:
    """Triton in explicit mode: the client loads on a miss and unloads past ``keep``."""

    def __init__(self, url: str, keep: int) -> None:
        self.url, self.keep = url, keep
        self.lock = threading.Lock()
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()

    def client(self) -> Callable[[str], None]:
        c = httpclient.InferenceServerClient(self.url)

        def call(name: str) -> None:
            with self.lock:
                missing = name not in self.loaded
                if missing:
                    c.load_model(name, headers=HEADERS)
                    self.loaded[name] = None
                    while len(self.loaded) > self.keep:
                        old, _ = self.loaded.popitem(last=False)
                        c.unload_model(old, headers=HEADERS)
                else:
                    self.loaded.move_to_end(name)
            infer(c, name)

        return call


X = np.ones((1, 16), np.float32)


def infer(c: httpclient.InferenceServerClient, name: str) -> None:
    tensors = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for t in tensors:
        t.set_data_from_numpy(X, binary_data=False)  # JSON on every server (the plain app's)
    out = c.infer(name, tensors).as_numpy("OUTPUT0")
    assert out is not None and out[0, 0] == 2.0, out


def timed(call: Callable[[str], None], name: str) -> float:
    start = time.perf_counter()
    call(name)
    return (time.perf_counter() - start) * 1e3


def working_set(server, names: list[str], seconds: float, threads: int = 4) -> dict:
    """Every model of the set touched once (loaded where it fits), then ``threads`` clients
    for ``seconds`` on random models of it."""
    call = server.client()
    for name in names:
        call(name)
    latencies: list[float] = []
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        call, rng = server.client(), random.Random(k)
        while time.monotonic() < stop:
            try:
                latencies.append(timed(call, rng.choice(names)))
            except (InferenceServerException, AssertionError) as exc:
                errors.append(str(exc)[:200])

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "models": len(names),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(latencies[len(latencies) // 2], 2) if latencies else None,
        "p99_ms": round(latencies[int(len(latencies) * 0.99)], 2) if latencies else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def measure(server, seconds: float) -> dict:
    call = server.client()
    cold = [timed(call, f"add_{i}") for i in range(90, 95)]  # room in the budget
    for i in range(20):  # fill it
        call(f"add_{i}")
    evicting = [timed(call, f"add_{i}") for i in range(95, 100)]
    warm = [timed(call, "add_99") for _ in range(200)]
    rng = random.Random(0)
    return {
        "cold_ms": round(statistics.median(cold), 1),
        "evicting_ms": round(statistics.median(evicting), 1),
        "warm_ms": round(statistics.median(warm), 2),
        "working_sets": [
            working_set(server, rng.sample([f"add_{i}" for i in range(MODELS)], n), seconds)
            for n in (10, 30)
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-mb", type=float, default=8.0)
    ap.add_argument("--budget-mb", type=float, default=0.0, help="0: ten models' measured charge")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/store"))
    args = ap.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="servekit-store-bench-") as tmp:
        root = Path(tmp)
        build_folder(root, args.weights_mb)
        budget = args.budget_mb
        if not budget:  # ten times one model's charge, measured by the store itself
            with ServerProcess(store_config(root, 12 * args.weights_mb)) as probe:
                probe.wait_ready([])
                c = httpclient.InferenceServerClient(probe.config.server.http_url[7:])
                # Loads into a fresh process read low while they reuse memory the allocator
                # kept (and the first is also charged the engine's start): the largest charge
                # of later loads, once evictions run, is the steady one.
                for i in range(10):
                    c.load_model(f"add_{i}", headers=HEADERS)
                charges = [
                    e["resident_bytes"] for e in c.get_model_repository_index()
                    if e.get("resident_bytes") and e["name"] != "add_0"
                ]  # fmt: skip
                budget = round(10 * max(charges) / 2**20, 1)
        print(f"budget {budget} MB", flush=True)
        config = store_config(root, budget)
        with ServerProcess(config) as native:
            native.wait_ready([])
            results["servekit native, [store] on_demand"] = measure(
                Native(config.server.http_url[7:]), args.seconds
            )
            print(json.dumps(results), flush=True)
        with plain_ray_multiplex(root) as url:
            results["plain Ray Serve app, @serve.multiplexed (10 per replica)"] = measure(
                Native(url), args.seconds
            )
            print(json.dumps(results), flush=True)
        server = ServerConfig.on_loopback(exit_timeout_s=2, control_token=TOKEN)
        options = TritonOptions(root / "triton", server, model_control_mode="explicit")
        with TritonProcess(options):
            results["tritonserver explicit mode, client-driven (keeps 10)"] = measure(
                TritonExplicit(server.http_url[7:], keep=10), args.seconds
            )
    machine = report_machine()
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "machine": machine,
        "budget_mb": budget,
        "weights_mb": args.weights_mb,
        "results": results,
    }
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    lines = [
        f"`{command}` on {machine}: {MODELS} add_sub models with {args.weights_mb:g} MB of "
        f"weights each, budget {budget} MB; one client for cold/evicting/warm (medians), four "
        "threads for the working sets; KServe JSON bodies.",
        "",
        "| server | cold ms | evicting ms | warm ms | set of 10: req/s | p50 | p99 | set of 30: req/s | p50 | p99 | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        a, b = r["working_sets"]
        lines.append(
            f"| {name} | {r['cold_ms']} | {r['evicting_ms']} | {r['warm_ms']} | "
            f"{a['requests_per_s']} | {a['p50_ms']} | {a['p99_ms']} | {b['requests_per_s']} | "
            f"{b['p50_ms']} | {b['p99_ms']} | {a['errors'] + b['errors']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


@contextlib.contextmanager
def plain_ray_multiplex(root: Path) -> Iterator[str]:
    """bench/plain_ray_multiplex.py in a process of its own; its host:port once it answers."""
    port = free_port()
    script = Path(__file__).with_name("plain_ray_multiplex.py")
    url = f"127.0.0.1:{port}"
    argv = [sys.executable, str(script), "--root", str(root), "--port", str(port)]
    ready = httpclient.InferenceServerClient(url).is_server_live
    with spawned(argv, ready, "the plain Ray multiplexing app"):
        yield url


def store_config(root: Path, budget_mb: float) -> ServeConfig:
    return ServeConfig(
        (), ServerConfig(exit_timeout_s=2, control_token=TOKEN), runtime="native",
        store=StoreConfig(root=str(root), memory_budget_mb=budget_mb, load="on_demand"),
    ).on_loopback()  # fmt: skip


if __name__ == "__main__":
    main()
