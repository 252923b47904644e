"""Where each servekit hop's CPU goes: py-spy samples of the serving process under load.

Each hop is served as ``servekit serve --config`` on loopback with ``add_sub``
(max_batch_size 8) and driven closed loop at concurrency 8 over HTTP binary tensors (gRPC
for the native gRPC row) while py-spy samples the process that holds servekit's code
(``--gil``: only samples in which its Python holds the GIL, so idle threads and waits
drop out). Samples are put in groups by the innermost frame that belongs to a known
package; the table gives each group's share beside the process's CPU per request,
measured in the same run.

    python bench/hops.py --out bench/results/hops
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench import MeasureConfig
from servekit.bench.compare import ServerProcess, Setup

sys.path.insert(0, str(Path(__file__).parent))
from serving_cost import measure  # noqa: E402

HOPS = [
    # (row, runtime, front, protocol)
    ("native, HTTP", "native", True, "http-binary"),
    ("native, gRPC", "native", True, "grpc"),
    ("front over tritonserver (servekit triton)", "triton", True, "http-binary"),
    ("front + PyTriton's model side (servekit serve)", "pytriton", True, "http-binary"),
    ("PyTriton's model side alone (serve --no-front)", "pytriton", False, "http-binary"),
]

GROUPS = [
    # (group, substrings of a frame), innermost match wins. A sample whose innermost
    # Python frame is the loop's run is in C: uvloop, the sockets, grpcio's Cython core.
    ("event loop in C (uvloop, sockets, grpcio core)", ("H1Server._run",)),
    ("servekit HTTP server, forwarding", ("servekit/http/h1.py", "servekit/front/http.py")),
    (
        "servekit request check, encode",
        ("servekit/protocol/kserve.py", "servekit/http/app.py", "servekit/spec.py"),
    ),
    ("servekit HTTP/2 server, hpack", ("servekit/grpc/h2.py", "hpack/")),
    ("servekit gRPC service", ("servekit/grpc/",)),
    ("protobuf", ("google/protobuf",)),
    ("servekit Batcher", ("servekit/batching/",)),
    ("model (runner)", ("servekit/runners/", "onnxruntime/")),
    ("servekit PyTriton adapter", ("servekit/pytriton/",)),
    ("PyTriton", ("pytriton/",)),
    ("ZeroMQ", ("zmq/",)),
    ("grpcio", ("grpc/", "grpc_")),
    ("json", ("json/", "orjson")),
    ("numpy", ("numpy/",)),
    ("asyncio event loop", ("asyncio/", "uvloop/")),
    ("threads, queues", ("threading.py", "queue.py", "concurrent/")),
]


def group_of(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        for name, needles in GROUPS:
            if any(n in frame for n in needles):
                return name
    return "other"


def sample(pid: int, seconds: float, out: Path) -> collections.Counter[str]:
    subprocess.run(
        [str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(pid),
         "-d", str(round(seconds)), "-r", "200", "--gil", "-f", "raw", "-o", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    groups: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        groups[group_of(stack)] += int(count)
    return groups


def drive(
    box: dict[str, object], url: str, setup: Setup, protocol: str, cfg: MeasureConfig
) -> None:
    box["point"] = measure(url, setup.target, setup.payload, protocol, cfg, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/hops"))
    ap.add_argument("--only", default="", help="Run only the hops whose name contains this.")
    args = ap.parse_args()
    model = ModelConfig(str(zoo.resolve("add_sub")), batching=BatchingPolicy(max_batch_size=8))
    setup = Setup.of(model)
    cfg = MeasureConfig(window_s=args.seconds, warmup_s=1.0, max_windows=3, stability=0.5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, runtime, front, protocol in HOPS:
            if args.only not in name:
                continue
            config = ServeConfig(
                (model,), ServerConfig(front=front, exit_timeout_s=2), runtime=runtime
            ).on_loopback()
            with ServerProcess(config) as server:
                server.wait_ready([setup.target])
                url = config.server.grpc_url if protocol == "grpc" else config.server.http_url
                box: dict[str, object] = {}
                pace = dataclasses.replace(cfg, server_pid=server.pid)
                load = threading.Thread(target=drive, args=(box, url, setup, protocol, pace))
                load.start()
                time.sleep(2.0)
                groups = sample(server.pid, args.seconds, Path(tmp) / "spy.txt")
                load.join()
            point = box["point"]
            total = sum(groups.values()) or 1
            rows.append(
                {
                    "hop": name,
                    "protocol": protocol,
                    "requests_per_s": point.stats.throughput,  # type: ignore[attr-defined]
                    "server_cpu_us": point.server_cpu_us,  # type: ignore[attr-defined]
                    "samples": total,
                    "groups": {g: n / total for g, n in groups.most_common()},
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "cpus": os.cpu_count(), "rows": rows}, indent=2)
    )
    lines = [f"`{command}`", ""]
    for r in rows:
        lines.append(
            f"**{r['hop']}** ({r['protocol']}): {r['requests_per_s']:.0f} requests/s, "
            f"{r['server_cpu_us']:.0f} us of the server's CPU per request (process tree), "
            f"{r['samples']} samples with the GIL held:"
        )
        lines.append("")
        lines.append("| where | share of GIL-held samples |")
        lines.append("| --- | ---: |")
        for g, share in r["groups"].items():
            if share >= 0.01:
                lines.append(f"| {g} | {share:.0%} |")
        lines.append("")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
