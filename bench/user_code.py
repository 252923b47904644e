"""Serving the user's own Python code: one cheap numpy model (add_sub in numpy,
bench/user_models.py) served by servekit on each runtime and by each peer as its users
write it, in one run: PyTriton binding the function itself (bench/peers/pytriton_direct.py),
MLServer's MLModel in process and with its default worker (bench/peers/mlserver_model.py),
LitServe's LitAPI (bench/peers/litserve_app.py), and a plain Ray Serve deployment.
Everyone batches up to 8 requests; every row is HTTP JSON, closed loop, at each
concurrency. Reported per request: the server's CPU (its whole process tree) and the
client's. MLServer and LitServe each run from a virtualenv of their own (``--mlserver``,
``--litserve``: the python of each), since their pins conflict with PyTriton's.

    python bench/user_code.py --mlserver /tmp/peer-mlserver/bin/python \\
        --litserve /tmp/peer-litserve/bin/python --out bench/results/user_code
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from serving_cost import cost_table, measure, median_row, plain_ray, row

from servekit import BatchingPolicy, Client, ModelConfig, RayOptions, ServeConfig, ServerConfig
from servekit.bench import MeasureConfig
from servekit.bench.compare import ServerProcess, spawned
from servekit.bench.loadgen import closed_loop
from servekit.bench.report import machine as report_machine
from servekit.endpoints import free_port

BENCH = Path(__file__).resolve().parent
PAYLOAD = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}
MAX_BATCH = 8


def code_model(name: str = "add_sub") -> ModelConfig:
    return ModelConfig(
        "user_models:AddSub", name, path=str(BENCH),
        batching=BatchingPolicy(max_batch_size=MAX_BATCH, max_queue_delay_us=500),
    )  # fmt: skip


def kserve_ready(url: str, model: str = "add_sub"):
    def ready() -> bool:
        with Client(url) as c:
            return c.is_ready(model)

    return ready


@contextlib.contextmanager
def pytriton_direct() -> Iterator[tuple[str, int]]:
    http = free_port()
    argv = [sys.executable, str(BENCH / "peers" / "pytriton_direct.py"), "--http-port", str(http),
            "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]  # fmt: skip
    url = f"http://127.0.0.1:{http}"
    with spawned(argv, kserve_ready(url), "PyTriton binding the function") as pid:
        yield url, pid


@contextlib.contextmanager
def mlserver(python: str, workers: int) -> Iterator[tuple[str, int]]:
    """MLServer serving the MLModel: ``workers`` 0 runs it in the server's process, 1 is
    MLServer's default (one inference worker process)."""
    http = free_port()
    with tempfile.TemporaryDirectory(prefix="mlserver-") as folder:
        root = Path(folder)
        (root / "mlserver_model.py").write_text((BENCH / "peers" / "mlserver_model.py").read_text())
        (root / "settings.json").write_text(json.dumps({
            "http_port": http, "grpc_port": free_port(), "metrics_port": free_port(),
            "host": "127.0.0.1", "parallel_workers": workers, "metrics_endpoint": None,
        }))  # fmt: skip
        model = root / "add_sub"
        model.mkdir()
        (model / "model-settings.json").write_text(json.dumps({
            "name": "add_sub", "implementation": "mlserver_model.AddSub",
            "max_batch_size": MAX_BATCH, "max_batch_time": 0.0005,
        }))  # fmt: skip
        url = f"http://127.0.0.1:{http}"
        argv = [str(Path(python).with_name("mlserver")), "start", str(root)]
        with contextlib.chdir(root), spawned(argv, kserve_ready(url), "MLServer") as pid:
            yield url, pid


@contextlib.contextmanager
def litserve(python: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [python, str(BENCH / "peers" / "litserve_app.py"), "--port", str(port),
            "--max-batch-size", str(MAX_BATCH)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        import urllib.request

        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200

    with spawned(argv, ready, "LitServe") as pid:
        yield url, pid


class LitServeTarget:
    """LitServe's own JSON API (/predict), posted as a LitServe user's client would."""

    remote = True

    def __init__(self, url: str) -> None:
        self.name = f"{url}/predict"
        self._url = f"{url}/predict"
        self._body = json.dumps({k: v[0].tolist() for k, v in PAYLOAD.items()}).encode()
        self._session = None

    async def send(self) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self._url, data=self._body, headers=headers) as r:
            answer = await r.read()
            if r.status != 200:
                raise RuntimeError(f"LitServe answered {r.status}: {answer[:200]!r}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def measure_litserve(url: str, cfg: MeasureConfig, level: int):
    async def run():
        target = LitServeTarget(url)
        try:
            return await closed_loop(target, level, cfg)
        finally:
            await target.close()

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="8,64")
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mlserver", help="python of a virtualenv with mlserver (skipped without)")
    ap.add_argument("--litserve", help="python of a virtualenv with litserve (skipped without)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--only", default="", help="Comma-separated rows of the first group.")
    ap.add_argument("--out", type=Path, default=Path("bench/results/user_code"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    cfg = MeasureConfig(window_s=args.window, warmup_s=1.0, max_windows=4, stability=0.15)
    rounds: dict[tuple[str, int], list[dict]] = {}

    def servekit_row(
        stack, runtime: str, name: str, model: ModelConfig, front: bool = True
    ) -> tuple[str, str, int]:
        config = ServeConfig(
            (model,), ServerConfig(exit_timeout_s=2, front=front), runtime=runtime,
            ray=RayOptions(model_cpus=0.5) if runtime == "ray" else RayOptions(),
        ).on_loopback()  # fmt: skip
        print(f"starting {name}", flush=True)
        server = stack.enter_context(ServerProcess(config))
        server.wait_ready([model.name])
        return name, config.server.http_url, server.pid

    groups = [
        ["native", "onnx", "pytriton", "pytriton-own", "triton", "direct", "mlserver", "litserve"]
    ]
    only = {w.strip() for w in args.only.split(",") if w.strip()}
    if only:
        groups = [[w for w in g if w in only] for g in groups]
    if not args.no_ray and not only:
        groups.append(["ray", "plain-ray"])  # Ray's background work would slow the others
    for group in groups:
        with contextlib.ExitStack() as stack:
            rows: list[tuple[str, str, int]] = []  # (row, url, server pid)
            for which in group:
                if which in ("native", "pytriton", "triton", "ray"):
                    rows.append(servekit_row(stack, which, f"servekit {which}", code_model()))
                elif which == "pytriton-own":  # Triton's own HTTP port: the front's share
                    name = "servekit pytriton --no-front (Triton's own port)"
                    rows.append(servekit_row(stack, "pytriton", name, code_model(), front=False))
                elif which == "onnx":
                    onnx_model = ModelConfig(
                        "add_sub", batching=BatchingPolicy(max_batch_size=MAX_BATCH)
                    )
                    rows.append(servekit_row(stack, "native", "servekit native, ONNX add_sub",
                                             onnx_model))  # fmt: skip
                elif which == "direct":
                    print("starting PyTriton binding the function", flush=True)
                    rows.append(
                        ("PyTriton, the function bound", *stack.enter_context(pytriton_direct()))
                    )
                elif which == "mlserver" and args.mlserver:
                    for workers, label in ((0, "in process"), (1, "default worker")):
                        print(f"starting MLServer {label}", flush=True)
                        url, pid = stack.enter_context(mlserver(args.mlserver, workers))
                        rows.append((f"MLServer 1.7.1, {label}", url, pid))
                elif which == "litserve" and args.litserve:
                    print("starting LitServe", flush=True)
                    rows.append(("LitServe 0.2.19", *stack.enter_context(litserve(args.litserve))))
                elif which == "plain-ray":
                    print("starting the plain Ray Serve app", flush=True)
                    url, pid = stack.enter_context(plain_ray(Path("numpy"), "add_sub", MAX_BATCH))
                    rows.append(("plain Ray Serve app (@serve.batch)", url, pid))
            for r in range(args.rounds):
                for name, url, pid in rows:
                    for level in levels:
                        measured = dataclasses.replace(cfg, server_pid=pid)
                        if name.startswith("LitServe"):
                            point = measure_litserve(url, measured, level)
                        else:
                            point = measure(url, "add_sub", PAYLOAD, "http-json", measured, level)
                        result = row(name, "http-json", point) | {"concurrency": level}
                        rounds.setdefault((name, level), []).append(result)
                        print(f"round {r + 1}: {json.dumps(result)}", flush=True)
    report(args, [median_row(m) for m in rounds.values()])


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    machine = report_machine()
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2)
    )
    lines = [
        f"`{command}` on {machine}: numpy add_sub as user code, HTTP JSON, closed loop, "
        f"max batch {MAX_BATCH}; each row is the median of {args.rounds} rounds by server CPU "
        "(its range beside it).",
        "",
        *cost_table(rows, ("server", "runtime"), ("concurrency", "concurrency")),
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
