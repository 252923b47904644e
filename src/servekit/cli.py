"""The ``servekit`` command line: build reference models, classify images, run the demo."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from . import zoo
from .errors import ServekitError

app = typer.Typer(help="servekit: serve deep-learning models in-process, on Triton and on Ray.")
models_app = typer.Typer(help="Reference models built locally from a fixed seed.")
app.add_typer(models_app, name="models")
console = Console()


def _model(model: str | Path, cache_dir: Path | None) -> Path:
    """A zoo model's file or an existing model file; anything else is a usage error."""
    from .errors import ModelNotFound

    try:
        return zoo.resolve(model, cache_dir)
    except ModelNotFound as exc:
        raise typer.BadParameter(str(exc), param_hint="MODEL") from None


CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir", help="Model cache (default $SERVEKIT_CACHE or ~/.cache/servekit/models)."
    ),
]
Front = Annotated[
    bool | None,
    typer.Option(
        "--front/--no-front",
        help="HTTP port served by servekit's hardened KServe front, Triton's own HTTP on "
        "loopback (default on; --no-front exposes Triton's HTTP API itself).",
    ),
]


@models_app.command("build")
def models_build(
    names: Annotated[
        list[str] | None, typer.Argument(help="Zoo models to build (default: resnet50).")
    ] = None,
    cache_dir: CacheDir = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when cached.")] = False,
) -> None:
    """Build zoo models into the cache (deterministic: same bytes every build)."""
    for name in names or ["resnet50"]:
        if name not in zoo.MODELS:
            raise typer.BadParameter(
                f"no zoo model {name!r}; available: {', '.join(sorted(zoo.MODELS))}"
            )
        start = time.perf_counter()
        with console.status(f"building {name}"):
            path = zoo.build(name, cache_dir, force=force)
        console.print(
            f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
        )


@models_app.command("list")
def models_list(cache_dir: CacheDir = None) -> None:
    """List zoo models and whether they are built."""
    directory = zoo.cache_dir(cache_dir)
    table = Table("name", "description", "built", title=f"cache: {directory}")
    for name, model in sorted(zoo.MODELS.items()):
        built = (directory / f"{name}.onnx").exists()
        table.add_row(name, model.description, "yes" if built else "no")
    console.print(table)


@app.command()
def infer(
    images: Annotated[
        list[Path], typer.Argument(help="JPEG/PNG files.", exists=True, dir_okay=False)
    ],
    model: Annotated[
        str,
        typer.Option(
            help="Zoo model or ONNX path (in-process); with --url, the served image model."
        ),
    ] = "resnet50",
    url: Annotated[
        str | None,
        typer.Option(
            help="Send to a running server (http://host:8000 or grpc://host:8001) instead."
        ),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", min=1)] = 5,
    labels: Annotated[Path | None, typer.Option(help="Text file, one label per line.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Classify images and print the top-k classes of each: in-process, or on a server with --url."""
    blobs = [p.read_bytes() for p in images]
    try:
        if url is not None:
            from .client import Client

            remote = model if model.endswith("_image") else f"{model}_image"
            with Client(url) as client:
                results = [preds[:top_k] for preds in client.classify(blobs, model=remote)]
        else:
            from .pipeline import image_classifier

            clf = image_classifier(model, top_k=top_k, labels=labels, cache_dir=cache_dir)
            try:
                results = clf.classify(blobs)
            finally:
                clf.close()
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    if as_json:
        out = {
            str(p): [{"label": r.label, "class_id": r.class_id, "score": r.score} for r in preds]
            for p, preds in zip(images, results, strict=True)
        }
        typer.echo(json.dumps(out, indent=2))
        return
    for path, preds in zip(images, results, strict=True):
        table = Table("rank", "class", "label", "score", title=str(path))
        for rank, p in enumerate(preds, 1):
            table.add_row(str(rank), str(p.class_id), p.label, f"{p.score:.4f}")
        console.print(table)


@app.command()
def serve(
    model: Annotated[
        str | None, typer.Option(help="Zoo model name or path to an ONNX file.")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="TOML/YAML file with the same settings.", exists=True)
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Served model name (default: zoo name or file stem).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    http_port: Annotated[int | None, typer.Option()] = None,
    grpc_port: Annotated[int | None, typer.Option()] = None,
    metrics_port: Annotated[int | None, typer.Option()] = None,
    instances: Annotated[int | None, typer.Option(min=1, help="Model instances.")] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="ONNX Runtime threads per session.")
    ] = None,
    max_batch_size: Annotated[int | None, typer.Option(min=1)] = None,
    preferred_batch_sizes: Annotated[
        str | None, typer.Option(help="Comma-separated, e.g. 8,16.")
    ] = None,
    max_queue_delay_us: Annotated[int | None, typer.Option(min=0)] = None,
    max_queue_size: Annotated[int | None, typer.Option(min=0, help="0 = unbounded.")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=1)] = None,
    labels: Annotated[Path | None, typer.Option(help="Labels file for the image model.")] = None,
    log_verbose: Annotated[int, typer.Option(help="Triton's --log-verbose level.")] = 0,
    runtime: Annotated[
        str, typer.Option(help="triton (PyTriton, HTTP+gRPC) or ray (Ray Serve, HTTP).")
    ] = "triton",
    front: Front = None,
    cache_dir: CacheDir = None,
) -> None:
    """Serve a model over KServe v2 HTTP/gRPC with Triton (PyTriton), or over HTTP on Ray
    Serve: the tensor model and, for image classifiers, <name>_image (images in, top-k out)."""
    from .config import load_config, policy_from_dict
    from .triton import ServerConfig, TritonSetupError, default_models
    from .triton import serve as run_server
    from .triton.server import load_onnx

    try:
        settings = load_config(config) if config else {}
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from None
    server = dict(settings.get("server", {}))
    for key, value in (
        ("host", host),
        ("http_port", http_port),
        ("grpc_port", grpc_port),
        ("metrics_port", metrics_port),
    ):
        if value is not None:
            server[key] = value
    server.setdefault("log_verbose", log_verbose)
    if front is not None:
        server["front"] = front
    batching = dict(settings.get("batching", {}))
    queue = dict(batching.pop("queue", {}))
    batching.setdefault("max_batch_size", 32)
    if max_batch_size is not None:
        batching["max_batch_size"] = max_batch_size
    if preferred_batch_sizes:
        batching["preferred_batch_sizes"] = [int(s) for s in preferred_batch_sizes.split(",")]
    if max_queue_delay_us is not None:
        batching["max_queue_delay_us"] = max_queue_delay_us
    if max_queue_size is not None:
        queue["max_queue_size"] = max_queue_size
    if runtime not in ("triton", "ray"):
        raise typer.BadParameter(f"runtime must be triton or ray, got {runtime!r}")
    if runtime == "ray":
        _serve_ray(
            model or settings.get("model", "resnet50"),
            name or settings.get("name"),
            {**batching, "queue": queue},
            server,
            instances or settings.get("instances", 1),
            top_k or settings.get("top_k", 5),
        )
        return
    try:
        policy = policy_from_dict({**batching, "queue": queue})
        source = model or settings.get("model", "resnet50")
        threads_ = threads or settings.get("threads")
        cache = cache_dir or settings.get("cache_dir")
        models = default_models(
            source,
            name=name or settings.get("name"),
            policy=policy,
            instance_count=instances or settings.get("instances", 1),
            intra_op_threads=threads_,
            top_k=top_k or settings.get("top_k", 5),
            labels=labels or settings.get("labels"),
            cache_dir=cache,
        )
        cfg = ServerConfig(**{"front": True, **server})
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        console.print(
            f"starting Triton with {[m.name for m in models]} (ready once all are loaded)"
        )

        def reload(server: Any) -> None:  # SIGHUP: read the model file again, swap it in live
            fresh = load_onnx(source, policy, intra_op_threads=threads_, cache_dir=cache)
            server.update(models[0].name, fresh)

        run_server(models, cfg, reload=reload)
    except TritonSetupError as exc:
        console.print(f"[red]cannot start Triton:[/red] {exc}")
        raise typer.Exit(3) from None
    except (ValueError, OSError, ServekitError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


@app.command()
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
        bool, typer.Option(help="Send inputs through system shared memory (same host only).")
    ] = False,
    access_token: Annotated[
        str | None, typer.Option(help="Token for restricted APIs (PyTriton's shared memory).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="HTTP: send JSON tensors, not binary.")
    ] = False,
) -> None:
    """Load-test a KServe v2 endpoint (perf_analyzer's method): closed loop over concurrency
    levels or open loop at Poisson request rates; windows repeat until stable."""
    import asyncio

    from .bench import MeasureConfig, open_target, parse_levels, sweep
    from .bench.payload import payload_from_metadata
    from .bench.report import plot_latency_vs_throughput, table, write_csv, write_json
    from .client import Client

    if (concurrency is None) == (request_rate is None):
        raise typer.BadParameter("give exactly one of --concurrency or --request-rate")
    mode, spec = ("concurrency", concurrency) if concurrency else ("rate", request_rate)
    try:
        levels = parse_levels(spec)  # type: ignore[arg-type]
        cfg = MeasureConfig(
            window_s=window,
            warmup_s=warmup,
            max_windows=max_windows,
            stability=stability,
            rows_per_request=batch_size,
        )
        with Client(url) as client:
            inputs = payload_from_metadata(client.metadata(model)["inputs"], batch_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None

    async def run() -> list:
        target = open_target(url, model, inputs)
        try:
            return await sweep(
                target, levels, mode, cfg, on_point=lambda p: console.print(table([p]))
            )
        finally:
            await target.close()

    try:
        with console.status(f"measuring {model} at {url}"):
            points = asyncio.run(run())
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    console.print(table(points, title=f"{model} at {url}"))
    if out is not None:
        series = {f"{model} ({url.split(':')[0]})": points}
        write_json(
            series, out.with_suffix(".json"), {"url": url, "model": model, "batch_size": batch_size}
        )
        write_csv(series, out.with_suffix(".csv"))
        plot_latency_vs_throughput(series, out.with_suffix(".png"), title=model)
        console.print(f"wrote {out.with_suffix('.json')}, .csv, .png")


@app.command()
def compare(
    runtimes: Annotated[
        str, typer.Option(help="Comma-separated: raw, batcher, pytriton, ensemble, ray.")
    ] = "raw,batcher,pytriton,ensemble,ray",
    concurrency: Annotated[str, typer.Option(help="Closed loop levels.")] = "1,2,4,8,16",
    model: Annotated[
        str, typer.Option(help="Zoo model or ONNX path (an image classifier).")
    ] = "resnet50",
    max_batch_size: Annotated[int, typer.Option(min=1)] = 8,
    instances: Annotated[int, typer.Option(min=1)] = 2,
    threads: Annotated[int | None, typer.Option(min=1, help="ORT threads per instance.")] = 1,
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
) -> None:
    """Start each runtime in turn on loopback with the same model and policy, run the same
    sweep, and write a Markdown report (table, share of raw, plot); unavailable runtimes
    are skipped and named."""
    import os
    import platform
    import shlex
    import sys

    from .batching import BatchingPolicy
    from .bench import MeasureConfig, parse_levels
    from .bench.compare import compare as run_compare
    from .bench.compare import markdown_report
    from .bench.report import plot_latency_vs_throughput, table, write_csv, write_json

    path = _model(model, cache_dir)
    try:
        levels = parse_levels(concurrency)
        cfg = MeasureConfig(window_s=window, warmup_s=warmup, max_windows=max_windows)
        result = run_compare(
            path,
            [r.strip() for r in runtimes.split(",") if r.strip()],
            levels,
            cfg,
            policy=BatchingPolicy(max_batch_size=max_batch_size),
            instances=instances,
            threads=threads,
            on_event=console.print,
            ceiling_seconds=ceiling_seconds,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    for name, points in result.series.items():
        console.print(table(points, title=name))
    command = "servekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_json(
        result.series, out.with_suffix(".json"), {"skipped": result.skipped, "command": command}
    )
    write_csv(result.series, out.with_suffix(".csv"))
    plot = None
    if result.series:
        plot_latency_vs_throughput(
            result.series, out.with_suffix(".png"), title="servekit compare: ResNet-50 on JPEGs"
        )
        plot = out.with_suffix(".png").name
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    out.with_suffix(".md").write_text(markdown_report(result, command, plot, machine))
    console.print(f"wrote {out.with_suffix('.md')}")


@app.command()
def optimize(
    model: Annotated[str, typer.Argument(help="Zoo model or ONNX path.")],
    precision: Annotated[str, typer.Option(help="fp32, fp16, bf16 or int8.")] = "int8",
    calibration: Annotated[
        Path | None, typer.Option(help="INT8: folder of calibration images.")
    ] = None,
    calibration_samples: Annotated[
        int,
        typer.Option(min=1, help="INT8: images to calibrate on (generated without --calibration)."),
    ] = 32,
    method: Annotated[
        str, typer.Option(help="INT8 calibration: minmax, entropy, percentile.")
    ] = "minmax",
    target: Annotated[
        str, typer.Option(help="INT8 activations for cpu (UINT8) or tensorrt (INT8).")
    ] = "cpu",
    sensitivity: Annotated[
        float,
        typer.Option(help="INT8: keep layers over N x the median sensitivity in FP32 (0 = none)."),
    ] = 4.0,
    output: Annotated[
        Path | None, typer.Option(help="Default: MODEL.PRECISION.onnx beside it.")
    ] = None,
    cache_dir: CacheDir = None,
) -> None:
    """Write the model at another precision: INT8 (static QDQ, calibrated through servekit's
    Preprocess) or FP16."""
    from .optimize import calibration_images
    from .optimize import optimize as run_optimize

    path = _model(model, cache_dir)
    try:
        images = (
            calibration_images(calibration, calibration_samples) if precision == "int8" else None
        )
        start = time.perf_counter()
        out = run_optimize(
            path,
            precision,
            output=output,
            images=images,
            method=method,
            target=target,
            sensitivity=sensitivity or None,
        )
    except (ValueError, ImportError) as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(
        f"{precision}: {out} ({out.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
    )


@app.command()
def accuracy(
    model: Annotated[
        str, typer.Argument(help="Candidate: zoo model, ONNX path, or a precision of --reference.")
    ],
    reference: Annotated[
        str, typer.Option(help="Reference ONNX model, or fp32 (the zoo model).")
    ] = "fp32",
    base: Annotated[
        str, typer.Option(help="Zoo model the precisions refer to.")
    ] = "efficientnet_lite0",
    images: Annotated[
        Path | None, typer.Option(help="Folder of images (default: the photo set).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Compare a model with its reference on a fixed image set: top-1 agreement, top-5
    overlap, relative logit error. ``servekit accuracy int8`` quantises --base and compares
    it with its FP32 self."""
    from .accuracy import compare_models
    from .optimize import PRECISIONS, calibration_images
    from .optimize import optimize as run_optimize

    ref = _model(base if reference == "fp32" else reference, cache_dir)
    if model in PRECISIONS:
        out = ref.with_name(f"{ref.stem}.{model}.onnx")
        cal = calibration_images(images) if images else None
        candidate = run_optimize(ref, model, output=out, images=cal)
    else:
        candidate = _model(model, cache_dir)
    blobs = calibration_images(images, samples=10_000) if images is not None else None
    report = compare_models(ref, candidate, blobs)
    if as_json:
        console.print_json(json.dumps(report.as_dict()))
        return
    table = Table("metric", "value", title=f"{report.candidate} against {report.reference}")
    for key, value in report.as_dict().items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)


@app.command()
def batch(
    input_dir: Annotated[Path, typer.Argument(help="Folder of images and/or .npy tensors.")],
    output: Annotated[Path, typer.Argument(help="Folder for the Parquet predictions.")],
    model: Annotated[str, typer.Option(help="Zoo model or ONNX path.")] = "resnet50",
    top_k: Annotated[int, typer.Option(min=1)] = 5,
    labels: Annotated[Path | None, typer.Option(help="Class names, one per line.")] = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    actors: Annotated[str, typer.Option(help="Actor pool: a size, or MIN,MAX to autoscale.")] = "2",
    actor_cpus: Annotated[float, typer.Option(help="CPUs reserved per actor.")] = 0.5,
    threads: Annotated[int | None, typer.Option(min=1, help="ORT threads per actor.")] = 1,
    address: Annotated[
        str | None, typer.Option(help="An existing Ray cluster (default: a local Ray).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Offline batch inference on Ray Data: score every file under INPUT_DIR with a pool
    of actors holding servekit runners and write one Parquet row per file to OUTPUT."""
    import shutil

    from .ray.batch import run_batch
    from .stages.classify import load_labels

    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise typer.BadParameter(f"{output} is not empty (use --overwrite)")
        shutil.rmtree(output)
    try:
        pool = tuple(int(v) for v in actors.split(","))
        if len(pool) not in (1, 2) or min(pool) < 1:
            raise ValueError
    except ValueError:
        raise typer.BadParameter(f"--actors takes N or MIN,MAX; got {actors!r}") from None
    # A local run builds a zoo model once here; a cluster's actors build it on their nodes.
    target = str(zoo.build(model, cache_dir)) if model in zoo.MODELS and not address else model
    names = None
    if labels is not None:
        names = list(load_labels(labels, _num_classes(target, cache_dir)))
    try:
        report = run_batch(
            input_dir,
            output,
            model=target,
            top_k=top_k,
            labels=names,
            batch_size=batch_size,
            actors=pool[0] if len(pool) == 1 else (pool[0], pool[1]),
            actor_cpus=actor_cpus,
            threads=threads,
            address=address,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(
        f"{report.rows} predictions for {report.files} files ({report.failed} failed) in "
        f"{report.seconds:.1f} s ({report.files_per_s:.1f} files/s) -> {report.output}"
    )
    for node, rows in sorted(report.rows_by_node.items()):
        console.print(f"  node {node[:12]}: {rows} rows")


def _num_classes(model: str, cache_dir: Path | None) -> int:
    from .runners.onnx import OnnxRuntimeRunner

    path = _model(model, cache_dir)
    with OnnxRuntimeRunner(path, intra_op_threads=1) as runner:
        return runner.spec.outputs[0].shape[0]


def _serve_ray(
    model: str, name: str | None, batching: dict, server: dict, replicas: int, top_k: int
) -> None:
    try:
        import ray
        from ray import serve as ray_serve

        from .ray import build_app
    except ImportError:
        console.print("[red]error:[/red] Ray Serve is not installed: pip install 'servekit[ray]'")
        raise typer.Exit(3) from None
    args = {"model": model, "batching": batching, "model_replicas": replicas, "top_k": top_k}
    if name:
        args["name"] = name
    host, port = server.get("host", "0.0.0.0"), int(server.get("http_port", 8000))
    import signal
    import threading

    ray.init(address="local", include_dashboard=False)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    # Ray's driver answers SIGTERM by aborting (exit -6); stop Serve and Ray cleanly instead.
    signal.signal(signal.SIGTERM, interrupted)
    hup = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    try:
        ray_serve.start(http_options={"host": host, "port": port})
        console.print(f"starting Ray Serve on http://{host}:{port} (KServe v2 over HTTP)")
        ray_serve.run(build_app(args), name="servekit", route_prefix="/")
        console.print("serving; SIGHUP redeploys from the model file")
        while True:  # SIGHUP: a rolling redeploy that re-reads the model file
            if hup.wait(0.5):
                hup.clear()
                try:
                    ray_serve.run(build_app(args), name="servekit", route_prefix="/")
                    console.print("redeployed")
                except Exception as exc:  # a failed update keeps the serving version
                    console.print(f"[red]redeploy failed, the serving version stays:[/red] {exc}")
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()
        ray.shutdown()


repo_app = typer.Typer(help="Triton model repositories rendered from servekit's configuration.")
app.add_typer(repo_app, name="repo")


@repo_app.command("build")
def repo_build(
    directory: Annotated[Path, typer.Argument(help="Repository folder (created if missing).")],
    force: Annotated[bool, typer.Option(help="Rebuild weights that already exist.")] = False,
    max_batch_size: Annotated[int, typer.Option(min=1)] = 16,
    instances: Annotated[int, typer.Option(min=1, help="instance_group count per model.")] = 1,
    threads: Annotated[
        int | None, typer.Option(min=1, help="ONNX Runtime threads per instance.")
    ] = None,
    cache_dir: CacheDir = None,
) -> None:
    """Write preprocess, resnet50, postprocess and resnet50_ensemble (configs and weights)."""
    from .batching import BatchingPolicy
    from .triton.repo import build_repository, reference_repository

    models = reference_repository(
        policy=BatchingPolicy(max_batch_size=max_batch_size), instances=instances, threads=threads
    )
    with console.status(f"building {directory}"):
        written = build_repository(directory, models, force=force, cache_dir=cache_dir)
    for path in written:
        console.print(f"wrote {path}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def triton(
    ctx: typer.Context,
    model_repository: Annotated[
        Path, typer.Option(help="Triton model repository.", exists=True, file_okay=False)
    ],
    model_control_mode: Annotated[
        str, typer.Option(help="none, poll or explicit (Triton's).")
    ] = "none",
    repository_poll_secs: Annotated[int, typer.Option(min=1)] = 5,
    load_model: Annotated[
        list[str] | None, typer.Option(help="With explicit: model to load at start.")
    ] = None,
    host: Annotated[str, typer.Option()] = "0.0.0.0",
    http_port: Annotated[int, typer.Option()] = 8000,
    grpc_port: Annotated[int, typer.Option()] = 8001,
    metrics_port: Annotated[int, typer.Option()] = 8002,
    log_verbose: Annotated[int, typer.Option()] = 0,
    restarts: Annotated[
        int,
        typer.Option(min=0, help="Restart a tritonserver that dies, up to N times (0 = never)."),
    ] = 5,
    inference_token: Annotated[
        str | None,
        typer.Option(
            envvar="SERVEKIT_INFERENCE_TOKEN",
            help="Require this servekit-inference-token header on inference.",
        ),
    ] = None,
    control_token: Annotated[
        str | None,
        typer.Option(
            envvar="SERVEKIT_CONTROL_TOKEN",
            help="Require this servekit-control-token header on model control and shared memory.",
        ),
    ] = None,
    front: Front = None,
) -> None:
    """Run the tritonserver bundled with PyTriton on a repository, with the servekit backend
    installed and the environment fixed. Other tritonserver flags pass through, e.g.
    `servekit triton --model-repository model_repository -- --strict-readiness=false`."""
    import signal

    from .triton.env import TritonSetupError
    from .triton.launcher import TritonOptions, TritonProcess

    try:
        options = TritonOptions(
            model_repository,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            model_control_mode=model_control_mode,
            repository_poll_secs=repository_poll_secs,
            load_models=tuple(load_model or ()),
            log_verbose=log_verbose,
            inference_token=inference_token,
            control_token=control_token,
            front=front is not False,
            extra_args=tuple(ctx.args),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    process = TritonProcess(options)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM (or Ctrl-C) at any moment stops Triton cleanly, also before wait() takes over.
    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        try:
            process.start()
        except TritonSetupError as exc:
            console.print(f"[red]cannot start Triton:[/red] {exc}")
            raise typer.Exit(3) from None
        via = f"servekit's front on {options.http_url}" if options.front else options.http_url
        console.print(
            f"tritonserver on {via} (gRPC {options.grpc_url}, "
            f"metrics {options.metrics_url}); log: {process.log_path}"
        )

        def restarted(count: int, why: str) -> None:
            console.print(f"[red]tritonserver {why}[/red]\nrestarting it ({count}/{restarts})")

        code = process.wait(max_restarts=restarts, on_restart=restarted)
    except KeyboardInterrupt:
        process.stop()
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    raise typer.Exit(code)


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="Zoo model name or ONNX path.")] = "resnet50",
    cache_dir: CacheDir = None,
) -> None:
    """Classify a generated image in-process with the reference ResNet-50."""
    from .pipeline import image_classifier
    from .stages import synthetic_image

    with console.status(f"loading {model}"):
        clf = image_classifier(model, cache_dir=cache_dir)
        clf.warmup()
    image = synthetic_image()
    start = time.perf_counter()
    preds = clf.classify([image])[0]
    ms = (time.perf_counter() - start) * 1e3
    table = Table(
        "rank", "class", "label", "score", title=f"generated {len(image)}-byte JPEG, {ms:.1f} ms"
    )
    for rank, p in enumerate(preds, 1):
        table.add_row(str(rank), str(p.class_id), p.label, f"{p.score:.4f}")
    console.print(table)
    clf.close()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
