"""Killed workers under load: failed requests and added latency per runtime.

For each runtime, the model (``--model``: add_sub, or ResNet-50 with eight fixed random
images whose answers are computed in-process first) is served under the Supervisor
(restarts at once, then backing off briefly) while ``--clients`` threads send requests
and check every answer (``--protocol``: over HTTP, gRPC, or half the clients each). The
model's worker process is SIGKILLed ``--kills`` times at random moments, each once the
last restart has answered requests again (triton: the servekit backend's Python stub;
pytriton: PyTriton's proxy stub; ray: the model replica, through ``ray.kill``). Reported:
requests answered right, wrong and failed, latency quantiles, the worst request, and the
restarts. Runs against any servekit checkout (``PYTHONPATH=<worktree>/src``), so a
commit before ``servekit.recovery`` gives the "before" figures in the same way.

    python bench/recovery.py --kills 10 --out bench/results/recovery.json
    python bench/recovery.py --model resnet50 --protocol both --out bench/results/recovery_resnet50.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from servekit import ModelConfig, RayOptions, ServeConfig, zoo
from servekit.bench.checked import Case, CheckedLoad
from servekit.bench.report import machine
from servekit.client import Client
from servekit.runtime.processes import processes
from servekit.runtime.supervisor import Supervisor
from servekit.serving import create_runtime


def wait(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        time.sleep(0.01)


def stub_of(workdir: Path) -> int | None:
    found = [
        pid
        for pid, argv in processes(str(workdir)).items()
        if argv[0].endswith("triton_python_backend_stub")
    ]
    return found[0] if len(found) == 1 else None


def cases(name: str, model: Path) -> list[Case]:
    """add_sub: none (CheckedLoad's random ones); ResNet-50: eight random images and the
    model's answers to them in-process."""
    if name == "add_sub":
        return []
    from servekit.runners.onnx import OnnxRuntimeRunner

    runner = OnnxRuntimeRunner(model)
    try:
        rng = np.random.default_rng(29)
        (tensor,) = runner.spec.inputs
        shape = (1, *tensor.shape)
        found = []
        for _ in range(8):
            x = {tensor.name: rng.standard_normal(shape, dtype=np.float32)}
            found.append((x, runner.infer(x)))
        return found
    finally:
        runner.close()


def loads(config: ServeConfig, args: argparse.Namespace, checked: list[Case]) -> list[CheckedLoad]:
    """The checked loads: all clients over one protocol, or half over each."""
    urls = {"http": [config.server.http_url], "grpc": [config.server.grpc_url],
            "both": [config.server.http_url, config.server.grpc_url]}[args.protocol]  # fmt: skip
    share = max(1, args.clients // len(urls))
    return [CheckedLoad(u, share, args.model, checked) for u in urls]


def run_triton(runtime: str, model: Path, args: argparse.Namespace) -> dict:
    config = ServeConfig((ModelConfig(str(model), args.model, image=False),), runtime=runtime)
    config = config.on_loopback()
    checked = cases(args.model, model)
    served = create_runtime(config)
    events: list[str] = []
    supervisor = Supervisor(
        served, max_restarts=4 * args.kills, check_s=0.2, backoff_s=0.05, max_backoff_s=0.2,
        on_event=events.append,
    )  # fmt: skip
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    url, rng = config.server.http_url, random.Random(args.seed)

    def workdir() -> Path:
        owner = served.process if runtime == "triton" else served  # type: ignore[attr-defined]
        return owner._workdir.path  # type: ignore[no-any-return]

    first = checked[0][0] if checked else {"INPUT0": np.ones((1, 16), np.float32),
                                             "INPUT1": np.ones((1, 16), np.float32)}  # fmt: skip

    def answering() -> bool:
        try:
            with Client(url) as c:
                c.infer(args.model, dict(first))
            return True
        except Exception:
            return False

    wait(answering, "first answer", 300)
    restarted_in_time = True
    clients = loads(config, args, checked)
    try:
        with contextlib.ExitStack() as stack:
            for load in clients:
                stack.enter_context(load)
            for _ in range(args.kills):
                seen = answered(clients)
                wait(
                    lambda seen=seen: answered(clients) > seen + (args.before or 50),
                    "answers before the kill",
                    120,
                )
                time.sleep(rng.uniform(0.1, 1.0))
                wait(lambda: stub_of(workdir()) is not None, "the worker's stub", 60)
                stub = stub_of(workdir())
                assert stub is not None
                restarts = events.count("restarted")
                os.kill(stub, signal.SIGKILL)
                try:
                    wait(
                        lambda restarts=restarts: events.count("restarted") > restarts,
                        "the restart",
                        120,
                    )
                except TimeoutError:
                    restarted_in_time = False
                    break
            time.sleep(1.0)
    finally:
        supervisor.request_stop()
        thread.join(120)
    return summary(clients, events.count("restarted"), restarted_in_time)


def run_ray(model: Path, args: argparse.Namespace) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import ray
        from ray import serve

        from servekit.ray import build_app
    from servekit.endpoints import free_port

    config = ServeConfig(
        (ModelConfig(str(model), args.model, image=False),), runtime="ray",
        ray=RayOptions(model_cpus=0.5),
    )  # fmt: skip
    checked = cases(args.model, model)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # fmt: skip
    port = free_port()
    rng = random.Random(args.seed)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        serve.run(build_app(config), name="servekit", route_prefix="/")
        Client(url).wait_ready(args.model, timeout_s=300)

        def replicas() -> list[str]:
            return [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if f"#{args.model}#" in a["name"]
            ]

        # Ray's ingress is HTTP only: every client on it.
        with CheckedLoad(url, args.clients, args.model, checked) as load:
            for _ in range(args.kills):
                seen = load.ok
                wait(
                    lambda seen=seen: load.ok > seen + (args.before or 20),
                    "answers before the kill",
                    120,
                )
                time.sleep(rng.uniform(0.1, 1.0))
                (name,) = replicas()
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                wait(lambda name=name: replicas() and replicas() != [name], "a new replica", 120)
            time.sleep(1.0)
        serve.delete("servekit")
    finally:
        serve.shutdown()
        ray.shutdown()
    return summary([load], args.kills, True)


def answered(loads: list[CheckedLoad]) -> int:
    return sum(load.ok for load in loads)


def summary(loads: list[CheckedLoad], restarts: int, restarted_in_time: bool) -> dict:
    lat = sorted(x for load in loads for x in load.latencies) or [float("nan")]

    def q(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 2)

    failures: dict[str, int] = {}
    for f in (f for load in loads for f in load.failures):
        failures[f] = failures.get(f, 0) + 1
    return {
        "ok": answered(loads), "wrong": sum(load.wrong for load in loads),
        "failed": sum(len(load.failures) for load in loads),
        "by_url": {load.url: load.ok for load in loads},
        "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(lat[-1] * 1e3, 1),
        "restarts": restarts, "restarted_in_time": restarted_in_time,
        "failures": sorted(failures.items(), key=lambda kv: -kv[1])[:5],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", default="triton,pytriton,ray")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--model", choices=("add_sub", "resnet50"), default="add_sub")
    parser.add_argument("--protocol", choices=("http", "grpc", "both"), default="http",
                        help="the clients' protocol (both: half each; Ray: HTTP)")  # fmt: skip
    parser.add_argument("--before", type=int, default=0,
                        help="right answers between kills (default: 50; Ray: 20)")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = zoo.build(args.model)
    results = {"machine": machine(), "kills": args.kills, "clients": args.clients,
               "model": args.model, "protocol": args.protocol}  # fmt: skip
    for runtime in args.runtimes.split(","):
        start = time.monotonic()
        result = run_ray(model, args) if runtime == "ray" else run_triton(runtime, model, args)
        result["seconds"] = round(time.monotonic() - start, 1)
        results[runtime] = result
        print(runtime, json.dumps(result), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
