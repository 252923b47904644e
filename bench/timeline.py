"""Where each runtime leaves the simulated T4 idle: its own timeline of batches.

Every runtime serves ``sim_t4`` as ``servekit compare`` serves it (max_batch_size 32, one
instance, one thread, no queue delay; gRPC, HTTP for Ray), closed loop at one
concurrency, with ``SERVEKIT_DEVICE_TIMELINE`` set so the device records each batch
(``servekit.bench.timeline``). Prints one row per runtime (rows/s, server CPU per
request, the device's busy share, overlapped hand-overs, the idle gap otherwise) and
draws the lanes. ``--overlap off,on`` runs the Triton runtimes and Ray with ``[models]
overlap`` off, then on; ``ray-direct`` is Ray with ``[ray] direct``; ``ray-plain`` is the
peer, a plain Ray Serve app with ``@serve.batch`` (bench/plain_ray_app.py, HTTP JSON) whose
model call is the same simulated device.

    python bench/timeline.py --runtimes native,pytriton,triton,ray,ray-direct,ray-plain \
        --overlap off,on --out bench/results/timeline_overlap
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from serving_cost import measure, plain_ray

from servekit.batching import BatchingPolicy
from servekit.bench.compare import Setup, compare
from servekit.bench.loadgen import MeasureConfig
from servekit.bench.timeline import draw, read, summarize
from servekit.cli.common import model_source
from servekit.config import ModelConfig
from servekit.runners import load_runner
from servekit.runners.simulated import TIMELINE_ENV, SimulatedDevice

OVERLAPPING = ("pytriton", "triton", "ray", "ray-direct")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtimes", default="native,pytriton,triton,ray")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument(
        "--overlap",
        default="on",
        help="on, off or off,on: [models] overlap on the Triton runtimes and Ray, each in turn",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/timeline_sim_t4"))
    args = ap.parse_args()
    base = ModelConfig(
        model_source("sim_t4", None), "sim_t4", batching=BatchingPolicy(max_batch_size=32),
        instances=args.instances, threads=1,
    )  # fmt: skip
    settings = MeasureConfig(window_s=args.window, warmup_s=2.0, max_windows=4, stable_windows=2)
    timelines, rows = {}, []
    device = load_runner(base.source)  # the zoo's sim_t4 declares its device
    assert isinstance(device, SimulatedDevice), device
    ceiling = device.profile.ceiling(32)
    device.close()
    with tempfile.TemporaryDirectory(prefix="servekit-timeline-") as folder:
        for runtime, overlap in (
            (r, o)
            for r in args.runtimes.split(",")
            for o in (args.overlap.split(",") if r in OVERLAPPING else ["on"])
        ):
            model = dataclasses.replace(base, overlap=overlap == "on")
            runtime_label = runtime
            if runtime in OVERLAPPING and "off" in args.overlap:
                runtime_label = f"{runtime} (overlap {overlap})"
            path = Path(folder) / f"{runtime}-{overlap}.jsonl"
            os.environ[TIMELINE_ENV] = str(path)  # every process of the server inherits it
            if runtime == "ray-plain":
                point = plain(model, args.concurrency, settings)
            else:
                result = compare(model, [runtime], [args.concurrency], settings, on_event=print)
                if runtime not in result.series:
                    print(f"skipped {runtime}: {result.skipped.get(runtime)}")
                    del os.environ[TIMELINE_ENV]
                    continue
                (point,) = result.series[runtime]
            del os.environ[TIMELINE_ENV]
            batches = read(path)
            timelines[runtime_label] = batches
            summary = summarize(batches)
            rows.append(
                {
                    "runtime": runtime_label,
                    "rows_per_s": round(point.stats.inferences_per_s, 1),
                    "ceiling_share": round(point.stats.inferences_per_s / ceiling, 4),
                    "server_cpu_us": round(point.server_cpu_us),
                    **summary.to_dict(),
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    draw(timelines, args.out.with_suffix(".png"))
    print(f"ceiling: {ceiling:.1f} rows/s at batch 32")
    print("| runtime | rows/s | share of the ceiling | server CPU us/request | device busy "
          "| next batch waiting | idle gap otherwise, median ms | rows per batch |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['runtime']} | {r['rows_per_s']} | {100 * r['ceiling_share']:.1f} % "
            f"| {r['server_cpu_us']} "
            f"| {100 * r['busy_share']:.1f} % | {100 * r['overlapped_share']:.0f} % "
            f"| {r['idle_gap_ms']:.2f} | {r['rows_per_batch']:.1f} |"
        )


def plain(model: ModelConfig, concurrency: int, settings: MeasureConfig):
    """The peer: bench/plain_ray_app.py serving the model (its device) with
    ``@serve.batch`` at the same max batch size, measured closed loop over HTTP JSON."""
    setup = Setup.of(model)
    with plain_ray(Path(model.source), setup.target, 32) as (url, pid):
        cfg = dataclasses.replace(settings, server_pid=pid)
        return measure(url, setup.target, setup.payload, "http-json", cfg, concurrency)


if __name__ == "__main__":
    main()
