"""Streams and sequences, servekit against tritonserver, in one run.

1. Server CPU per request over a gRPC stream (each client's requests over one stream of
   its own, ``servekit bench --streaming``) against unary gRPC calls, on ``add_sub``:
   servekit native, and tritonserver's own gRPC port (the triton runtime with
   ``front = false``: tritonserver serves the stream, the servekit backend the model).
2. Sequences per second at 1 to 64 concurrent sequences of ``--length`` requests each
   (``--sequence-length``, unary gRPC calls: PyTriton's tritonserver dies (SIGSEGV in its
   Python backend) under 64 concurrent streams, see part 1), for the ``direct`` and
   ``oldest`` strategies:
   servekit native's sequence batcher on the ONNX ``accumulate`` with implicit state,
   against tritonserver's own sequence batcher on a Python-backend accumulator keyed by
   CORRID (``peers/triton_accumulate.py``). Both hold 64 places (2 instances x 32).

Each row is the median of ``--rounds`` rounds by server CPU per request (its whole
process tree), with the range beside it.

    python bench/streams.py --out bench/results/streams
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from serving_cost import cost_table, median_row, row

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig
from servekit.batching.sequence import SequencePolicy, StateSpec
from servekit.bench import MeasureConfig
from servekit.bench.compare import ServerProcess
from servekit.bench.loadgen import closed_loop
from servekit.bench.report import machine as report_machine
from servekit.bench.targets import open_target
from servekit.errors import ServekitError

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from triton_accumulate import serve as triton_accumulate  # noqa: E402

ADD_SUB = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}
ONES = {"INPUT": np.ones((1, 4), np.float32)}
PLACES = (2, 32)  # instances, slots or candidates each


def measure(url, model, payload, cfg, level, *, streaming=False, length=0):
    """One closed-loop point; a server that died mid-way (tritonserver under load) gives
    an empty one with the reason, and the run goes on."""

    async def run():
        target = open_target(url, model, payload, streaming=streaming, sequence_length=length)
        try:
            return await closed_loop(target, level, cfg)
        finally:
            await target.close()

    try:
        return asyncio.run(run())
    except ServekitError as exc:
        print(f"failed: {exc}", flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="8,64", help="Part 1's client counts.")
    ap.add_argument("--sequences", default="1,8,64", help="Part 2's concurrent sequences.")
    ap.add_argument("--length", type=int, default=8, help="Requests per sequence.")
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="streams,sequences")
    ap.add_argument("--out", type=Path, default=Path("bench/results/streams"))
    args = ap.parse_args()
    cfg = MeasureConfig(window_s=args.window, warmup_s=1.0, max_windows=4, stability=0.15)
    only = set(args.only.split(","))
    results: dict[str, list[dict]] = {"streams": [], "sequences": []}

    if "streams" in only:
        rounds: dict[tuple, list[dict]] = {}
        model = ModelConfig("add_sub", batching=BatchingPolicy(max_batch_size=8))
        with contextlib.ExitStack() as stack:
            servers = []
            for name, runtime, front in (
                ("servekit native", "native", True),
                ("tritonserver's own gRPC (triton --no-front)", "triton", False),
            ):
                config = ServeConfig(
                    (model,), ServerConfig(exit_timeout_s=2, front=front), runtime=runtime
                ).on_loopback()
                print(f"starting {name}", flush=True)
                server = stack.enter_context(ServerProcess(config))
                server.wait_ready(["add_sub"])
                servers.append((name, config.server.grpc_url, server.pid))
            for r in range(args.rounds):
                for name, url, pid in servers:
                    for level in [int(c) for c in args.concurrency.split(",")]:
                        for how, streaming in (("unary gRPC", False), ("gRPC stream", True)):
                            point = measure(
                                url, "add_sub", ADD_SUB,
                                dataclasses.replace(cfg, server_pid=pid), level,
                                streaming=streaming,
                            )  # fmt: skip
                            if point is None:
                                continue
                            result = row(name, how, point) | {"concurrency": level}
                            rounds.setdefault((name, how, level), []).append(result)
                            print(f"round {r + 1}: {json.dumps(result)}", flush=True)
        results["streams"] = [median_row(m) for m in rounds.values()]

    if "sequences" in only:
        rounds = {}
        instances, places = PLACES
        for strategy in ("direct", "oldest"):
            policy = SequencePolicy(
                strategy,
                max_candidate_sequences=places,
                states=(StateSpec("STATE_IN", "STATE_OUT"),),
            )
            model = ModelConfig(
                "accumulate", batching=BatchingPolicy(max_batch_size=places),
                instances=instances, sequence_batching=policy,
            )  # fmt: skip
            config = ServeConfig(
                (model,), ServerConfig(exit_timeout_s=2), runtime="native"
            ).on_loopback()
            with contextlib.ExitStack() as stack:
                print(f"starting servekit native ({strategy})", flush=True)
                server = stack.enter_context(ServerProcess(config))
                server.wait_ready(["accumulate"])
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                print(f"starting tritonserver's sequence batcher ({strategy})", flush=True)
                triton = stack.enter_context(
                    triton_accumulate(
                        folder, strategy, max_batch=places, instances=instances,
                        candidates=places,
                    )
                )  # fmt: skip
                rows = [
                    ("servekit native, ONNX + implicit state", config.server.grpc_url, server.pid),
                    ("tritonserver, Python backend keyed by CORRID",
                     triton.options.server.grpc_url, triton._proc.pid),
                ]  # fmt: skip
                for r in range(args.rounds):
                    for name, url, pid in rows:
                        for level in [int(c) for c in args.sequences.split(",")]:
                            point = measure(
                                url, "accumulate", ONES,
                                dataclasses.replace(cfg, server_pid=pid), level,
                                length=args.length,
                            )  # fmt: skip
                            if point is None:
                                continue
                            result = row(name, strategy, point) | {
                                "concurrency": level,
                                "sequences_per_s": point.stats.throughput / args.length,
                            }
                            rounds.setdefault((name, strategy, level), []).append(result)
                            print(f"round {r + 1}: {json.dumps(result)}", flush=True)
        results["sequences"] = [median_row(m) for m in rounds.values()]
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    machine = report_machine()
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "machine": machine, **results}, indent=2)
    )
    lines = [f"`{command}` on {machine}; each row is the median of {args.rounds} rounds by "
             "server CPU (its range beside it).", ""]  # fmt: skip
    if results["streams"]:
        lines += ["add_sub, closed loop, one stream per client or unary calls:", ""]
        lines += cost_table(
            results["streams"], ("server", "runtime"), ("calls", "protocol"),
            ("clients", "concurrency"),
        )  # fmt: skip
        lines.append("")
    if results["sequences"]:
        lines += [f"accumulate, sequences of {args.length} over unary gRPC, closed loop:", ""]
        for r in results["sequences"]:
            r["sequences/s"] = f"{r['sequences_per_s']:.0f}"
        lines += cost_table(
            results["sequences"], ("server", "runtime"), ("strategy", "protocol"),
            ("sequences", "concurrency"), ("sequences/s", "sequences/s"),
        )  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
