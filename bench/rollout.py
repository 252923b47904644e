"""How many requests each canary verdict took, on a runtime under steady load.

Three scenarios with add_sub as version 1: a slow version 2 (the same answers through 200
identity MatMuls) at 20 %, an identical version 2 at 10 % promoted along [10, 50, 100],
and a version 2 whose OUTPUT0 is off by one, at 0 % with every request shadowed on it.
Each is served by ``--runtime`` (native, pytriton or triton) from this process and driven by ``--threads``
closed-loop HTTP clients until the canary's judgement ends; every verdict event is
reported with the requests each version had in its window and the time since the start.

    python bench/rollout.py --out bench/results/rollout
    python bench/rollout.py --runtime triton --out bench/results/rollout_triton
    python bench/rollout.py --repeat 50 --min-requests 60 --scenario "identical canary at 20 %, limit 1.5x" \
        --scenario "1.5x slower canary at 20 %, limit 1.25x" --out bench/results/canary_noise
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig
from servekit.rollout import CanaryPolicy, ModelVersion, TrafficPolicy
from servekit.serving import create_runtime
from servekit.zoo.tiny import build_add_sub

BODY = json.dumps(
    {
        "inputs": [
            {"name": n, "datatype": "FP32", "shape": [1, 16], "data": np.ones(16).tolist()}
            for n in ("INPUT0", "INPUT1")
        ]
    }
)

ENDS = ("promoted", "rolled back", "held")

SCENARIOS = {  # version 1's and 2's build_add_sub arguments, the split, the end, max_p99_ratio
    "slow canary at 20 %": ({}, {"heavy": 200}, TrafficPolicy({1: 80, 2: 20}), "rolled back", 1.5),
    "identical canary from 10 %": ({}, {}, TrafficPolicy({1: 90, 2: 10}), "promoted", 20.0),
    "other answers, shadowed at 0 %": (
        {},
        {"offset": 1.0},
        TrafficPolicy({1: 100}, shadow=2),
        "rolled back",
        20.0,
    ),
    # The canary's false and true alarms at the default limits (--repeat 50):
    "identical canary at 20 %, limit 1.5x": (
        {},
        {},
        TrafficPolicy({1: 80, 2: 20}),
        "promoted",
        1.5,
    ),
    "1.5x slower canary at 20 %, limit 1.25x": (
        {"heavy": 100},
        {"heavy": 150},
        TrafficPolicy({1: 80, 2: 20}),
        "rolled back",
        1.25,
    ),
}


def run(
    name: str, folder: Path, min_requests: int, threads: int, timeout_s: float, runtime: str
) -> dict:
    v1_args, v2_args, traffic, until, ratio = SCENARIOS[name]
    onnx.save(build_add_sub(**v1_args), folder / "v1.onnx")
    onnx.save(build_add_sub(**v2_args), folder / "v2.onnx")
    canary = CanaryPolicy(min_requests=min_requests, max_p99_ratio=ratio)
    model = ModelConfig(
        str(folder / "v1.onnx"), "m", batching=BatchingPolicy(max_batch_size=8),
        versions=(ModelVersion(2, str(folder / "v2.onnx")),), traffic=traffic, canary=canary,
    )  # fmt: skip
    config = ServeConfig((model,), ServerConfig(exit_timeout_s=2), runtime=runtime).on_loopback()
    server = create_runtime(config)
    server.start()
    stop, sent, failed = threading.Event(), [0], [0]

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", config.server.http_port, timeout=30)
        while not stop.is_set():
            conn.request("POST", "/v2/models/m/infer", body=BODY)
            r = conn.getresponse()
            r.read()
            sent[0] += 1
            failed[0] += r.status != 200
        conn.close()

    workers = [threading.Thread(target=client) for _ in range(threads)]
    start = time.monotonic()
    for w in workers:
        w.start()

    def traffic_state() -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", config.server.http_port, timeout=30)
        try:
            conn.request("GET", "/v2/models/m/traffic")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    try:
        while time.monotonic() - start < timeout_s:  # until judging ends, either way
            if traffic_state()["canary"]["state"] in (until, *ENDS):
                break
            time.sleep(0.05)
    finally:
        stop.set()
        for w in workers:
            w.join()
        state = traffic_state()
        server.stop()
    return {
        "scenario": name,
        "reached": state["canary"]["state"],
        "requests_sent": sent[0],
        "failed": failed[0],
        "seconds": round(time.monotonic() - start, 2),
        "verdicts": [
            {
                "event": e["event"],
                "after_s": round(e["time"] - state["events"][0]["time"], 2)
                if state["events"]
                else 0,
                "why": e["why"],
                "window_requests": {v: f["requests"] for v, f in e.get("figures", {}).items()},
            }
            for e in state["events"]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", default="native", choices=["native", "pytriton", "triton"])
    ap.add_argument("--min-requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--scenario", action="append", help="run only these (repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario")
    ap.add_argument("--out", type=Path, default=Path("bench/results/rollout"))
    args = ap.parse_args()
    results = []
    for name in args.scenario or list(SCENARIOS)[:3]:
        reached = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(
                    run(
                        name, Path(tmp), args.min_requests, args.threads, args.timeout, args.runtime
                    )
                )
            reached.append(results[-1]["reached"])
            print(json.dumps(results[-1]), flush=True)
        print(f"{name}: {', '.join(f'{reached.count(r)} {r}' for r in sorted(set(reached)))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
