"""``servekit bench`` (load-test an endpoint) and ``servekit compare`` (every runtime, one report)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import ServekitError
from .common import CacheDir, ConfigFile, console, model_source, serve_config

__all__ = ["bench", "compare"]


def bench(
    url: Annotated[
        str, typer.Option(help="KServe v2 endpoint: http://host:8000 or grpc://host:8001.")
    ],
    model: Annotated[str, typer.Option(help="Served model name.")] = "resnet50",
    concurrency: Annotated[
        str | None, typer.Option(help="Closed loop levels: start:end:step, start:end:xF or a,b,c.")
    ] = None,
    request_rate: Annotated[
        str | None, typer.Option(help="Open loop (Poisson) rates in requests/s, same syntax.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows per request.")] = 1,
    window: Annotated[float, typer.Option(help="Measurement window, seconds.")] = 5.0,
    warmup: Annotated[float, typer.Option(help="Warm-up before each level, seconds.")] = 2.0,
    max_windows: Annotated[int, typer.Option(min=3)] = 10,
    stability: Annotated[
        float, typer.Option(help="Tolerance for stable windows (0.1 = 10%).")
    ] = 0.1,
    out: Annotated[Path | None, typer.Option(help="Write OUT.json, OUT.csv and OUT.png.")] = None,
    shared_memory: Annotated[
        str,
        typer.Option(
            help="none, system or cuda: send inputs, and take outputs, through system "
            "shared memory or through CUDA shared memory on GPU 0, as perf_analyzer's "
            "--shared-memory (same host only; cuda needs cuda-python)."
        ),
    ] = "none",
    access_token: Annotated[
        str | None,
        typer.Option(help="The control token, to register shared memory where one is set."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="HTTP: send JSON tensors, not binary.")
    ] = False,
    server_pid: Annotated[
        int | None,
        typer.Option(help="Measure this server process tree's CPU per request (same host)."),
    ] = None,
    streaming: Annotated[
        bool, typer.Option(help="gRPC: each client's requests over one stream of its own.")
    ] = False,
    sequence_length: Annotated[
        int,
        typer.Option(min=0, help="Each client runs sequences of N requests (START ... END)."),
    ] = 0,
    images: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            help="An encoded image a BYTES input sends (repeat the option; cycled over the "
            "rows). Default: generated 320x240 JPEGs.",
        ),
    ] = None,
    input_data: Annotated[
        str,
        typer.Option(
            help="What the requests carry, as perf_analyzer's --input-data: zero, random, "
            'random:LOW:HIGH (uniform), a JSON file ({"data": [{"INPUT": [...]}, ...]}, '
            "one row an entry, sent in turn) or a folder of one raw file per input."
        ),
    ] = "random",
    shapes: Annotated[
        list[str] | None,
        typer.Option(
            "--shape",
            help="NAME:D1,D2: an input's variable dimensions, batch excluded (repeat).",
        ),
    ] = None,
    timeout_ms: Annotated[
        float | None,
        typer.Option(
            help="Each client's deadline: it gives up on an answer not come in this long, "
            "closing its connection (cancelling its gRPC call), and sends it as the "
            "request's KServe timeout parameter. Reports goodput: answers in time, per second.",
        ),
    ] = None,
    retries: Annotated[
        int,
        typer.Option(
            min=0,
            help="Send a request that timed out or was refused (503 / UNAVAILABLE) again, up "
            "to N more times; after a refusal once its Retry-After has passed, capped by the "
            "time left before the deadline.",
        ),
    ] = 0,
) -> None:
    """Load-test a KServe v2 endpoint (perf_analyzer's method): closed loop over concurrency
    levels or open loop at Poisson request rates; windows repeat until stable."""
    import asyncio

    from ..bench import MeasureConfig, open_target, parse_levels, sweep
    from ..bench.inputdata import load_input_data, parse_shapes
    from ..bench.loadgen import Point
    from ..bench.report import (
        goodput_table,
        plot_latency_vs_throughput,
        table,
        write_csv,
        write_json,
    )
    from ..client import Client

    if (concurrency is None) == (request_rate is None):
        raise typer.BadParameter("give exactly one of --concurrency or --request-rate")
    if (streaming or sequence_length) and request_rate is not None:
        raise typer.BadParameter("--streaming and --sequence-length run a closed loop")
    if (streaming or sequence_length) and (timeout_ms is not None or retries):
        raise typer.BadParameter(
            "--timeout-ms and --retries give up on and resend single requests: not with "
            "--streaming (a stream's requests cannot be left one by one) or --sequence-length "
            "(a sequence's steps cannot be repeated)"
        )
    mode, spec = ("concurrency", concurrency) if concurrency else ("rate", request_rate)
    try:
        levels = parse_levels(spec)  # type: ignore[arg-type]
        cfg = MeasureConfig(
            window_s=window,
            warmup_s=warmup,
            max_windows=max_windows,
            stability=stability,
            rows_per_request=batch_size,
            server_pid=server_pid,
            timeout_ms=timeout_ms,
            retries=retries,
        )
        with Client(url) as client:
            photos = [p.read_bytes() for p in images or ()]
            inputs = load_input_data(
                input_data,
                client.metadata(model)["inputs"],
                batch_size,
                parse_shapes(shapes or ()),
                images=photos,
            )
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None

    def progress(point: Point) -> None:
        """One line per level as it finishes; the table comes once, at the end."""
        s = point.stats
        good = f", goodput {s.goodput:.1f} req/s ({s.goodput_share:.0%} in time)"
        console.print(
            f"{mode} {point.level:g}: {s.inferences_per_s:.1f} infer/s, p99 {s.p99_ms:.2f} ms"
            + (good if point.deadlines else "")
        )

    async def run() -> list:
        target = open_target(
            url,
            model,
            inputs,
            shared_memory=_shared_memory(shared_memory),
            access_token=access_token,
            binary=not as_json,
            streaming=streaming,
            sequence_length=sequence_length,
        )
        try:
            return await sweep(target, levels, mode, cfg, on_point=progress)
        finally:
            await target.close()

    try:
        with console.status(f"measuring {model} at {url}"):
            points = asyncio.run(run())
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    console.print(table(points, title=f"{model} at {url}"))
    if any(p.deadlines for p in points):
        deadline = f"{timeout_ms:g} ms deadline" if timeout_ms is not None else "no deadline"
        console.print(goodput_table(points, title=f"{deadline}, {retries} retries"))
    if out is not None:
        series = {f"{model} ({url.split(':')[0]})": points}
        meta = {"url": url, "model": model, "batch_size": batch_size}
        if timeout_ms is not None or retries:
            meta.update(timeout_ms=timeout_ms, retries=retries)
        write_json(series, out.with_suffix(".json"), meta)
        write_csv(series, out.with_suffix(".csv"))
        plot_latency_vs_throughput(series, out.with_suffix(".png"), title=model)
        console.print(f"wrote {out.with_suffix('.json')}, .csv, .png")


def compare(
    runtimes: Annotated[
        str,
        typer.Option(
            help="Comma-separated: raw, batcher, native, pytriton, triton, ray, ray-direct "
            "(Ray with [ray] direct), ray-direct-fused (and [ray] fuse)."
        ),
    ] = "raw,batcher,native,pytriton,triton,ray",
    concurrency: Annotated[str, typer.Option(help="Closed loop levels.")] = "1,2,4,8,16",
    model: Annotated[
        str, typer.Option(help="Zoo model or ONNX path (an image classifier).")
    ] = "resnet50",
    config: ConfigFile = None,
    max_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Default 8; with --config, the file's.")
    ] = None,
    instances: Annotated[
        int | None, typer.Option(min=1, help="Default 2; with --config, the file's.")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="ORT threads per instance. Default 1; with --config, the file's."),
    ] = None,
    rounds: Annotated[
        int,
        typer.Option(
            min=1, help="Rounds of the whole sweep, the runtimes interleaved: the intervals' n."
        ),
    ] = 3,
    window: Annotated[float, typer.Option()] = 5.0,
    warmup: Annotated[float, typer.Option()] = 3.0,
    max_windows: Annotated[int, typer.Option(min=3)] = 8,
    ceiling_seconds: Annotated[
        float, typer.Option(help="Seconds per batch size for the raw ceiling (0 = skip).")
    ] = 8.0,
    out: Annotated[Path, typer.Option(help="Writes OUT.md, OUT.json, OUT.csv, OUT.png.")] = Path(
        "bench/results/compare"
    ),
    cache_dir: CacheDir = None,
    protocol: Annotated[
        str, typer.Option(help="grpc, http-binary or http-json (Ray: HTTP only).")
    ] = "grpc",
    ports: Annotated[
        str | None,
        typer.Option(
            help="FIRST:LAST: every port a served runtime opens is chosen in this range "
            "(default: free ones in 20000-32767)."
        ),
    ] = None,
) -> None:
    """Start every runtime on loopback with the same model and policy (a --config file's
    policy is used as given), run the same sweep against each, round after round with the
    runtimes interleaved, and write a Markdown report: each runtime's effective policy, a
    verdict per figure (a winner only beyond noise), each figure with its 95 % interval,
    where the time goes, and a plot; unavailable runtimes are skipped and named."""
    import shlex
    import sys

    from ..bench import MeasureConfig, parse_levels
    from ..bench.compare import compare as run_compare
    from ..bench.compare_report import markdown_report
    from ..bench.report import (
        machine,
        plot_latency_vs_throughput,
        table,
        write_csv,
        write_json,
    )
    from ..endpoints import parse_port_range

    defaults = config is None  # a file's policy is the one compared, unless a flag says
    cfg = serve_config(
        config,
        models=None if config else [model_source(model, cache_dir)],
        cache_dir=cache_dir,
        instances=instances if instances is not None or not defaults else 2,
        threads=threads if threads is not None or not defaults else 1,
        max_batch_size=max_batch_size if max_batch_size is not None or not defaults else 8,
    )
    try:
        levels = parse_levels(concurrency)
        mcfg = MeasureConfig(window_s=window, warmup_s=warmup, max_windows=max_windows)
        result = run_compare(
            cfg.models[0],
            [r.strip() for r in runtimes.split(",") if r.strip()],
            levels,
            mcfg,
            on_event=console.print,
            ceiling_seconds=ceiling_seconds,
            protocol=protocol,
            ports=parse_port_range(ports) if ports else None,
            rounds=rounds,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:  # the port range ran out
        raise typer.BadParameter(str(exc), param_hint="--ports") from None
    series = result.series  # each level's median round
    for name, points in series.items():
        console.print(table(points, title=f"{name} (median round)"))
    command = "servekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    load = (
        f"closed loop at concurrency {', '.join(f'{v:g}' for v in levels)} over {protocol}, "
        f"{warmup:g} s warm-up, windows of {window:g} s until three agree (at most {max_windows})"
    )
    extra = {
        "skipped": result.skipped, "command": command, "model": result.model, "load": load,
        "machine": machine(), "policies": result.policies, "notes": result.notes,
        "time_spent_us": result.time_spent,
        "rounds": {k: [[p.as_dict() for p in r] for r in v] for k, v in result.rounds.items()},
    }  # fmt: skip
    write_json(series, out.with_suffix(".json"), extra)
    write_csv(series, out.with_suffix(".csv"))
    plot = None
    if series:
        title = f"servekit compare: {result.model}, {protocol}, {machine()}"
        plot_latency_vs_throughput(series, out.with_suffix(".png"), title=title)
        plot = out.with_suffix(".png").name
    report = markdown_report(result, command, plot, machine(), load)
    out.with_suffix(".md").write_text(report)
    for line in report.split("## Verdicts", 1)[-1].split("## Figures", 1)[0].splitlines():
        if line.strip():
            console.print(line)
    console.print(f"wrote {out.with_suffix('.md')}")


def _shared_memory(kind: str) -> str | None:
    """``--shared-memory`` as the client takes it (None: tensors over the socket); CUDA
    regions are made on GPU 0 of this host."""
    if kind not in ("none", "system", "cuda"):
        raise typer.BadParameter(f"--shared-memory: none, system or cuda, got {kind!r}")
    return None if kind == "none" else kind
