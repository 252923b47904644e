"""``servekit compare``: every runtime in turn, same model, same policy, same load, one report.

Each runtime is a context manager that starts it on loopback and yields a factory of
load-generator targets (made inside the measuring event loop) for the image model (JPEG in,
top-5 out): the in-process Pipeline, servekit's Batcher in front of it, and every runtime
of ``servekit serve`` built from one ``ServeConfig``. Runtimes that cannot run here are
skipped and named with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..batching import Batcher
from ..config import ModelConfig, RayOptions, ServeConfig, ServerConfig, image_model_name
from ..endpoints import PortRange
from ..stages import synthetic_image
from .cpu import tree_cpu_by_title
from .loadgen import MeasureConfig, Point, sweep
from .process import ServerProcess, spawned
from .stats import rows_per_s
from .targets import BatcherTarget, RunnerTarget, open_target

__all__ = [
    "PROTOCOLS",
    "RUNTIMES",
    "ComparisonResult",
    "ServerProcess",
    "Setup",
    "Targets",
    "compare",
    "effective_policy",
    "spawned",
    "target_url",
]


@dataclass(frozen=True)
class Setup:
    model: ModelConfig
    """The model (file, policy, instances, threads) every runtime serves."""
    target: str
    """The served model the load goes to: ``<name>_image`` for an image classifier."""
    payload: dict[str, np.ndarray]
    image: bool
    protocol: str = "grpc"
    """How the served runtimes are reached: ``grpc``, ``http-binary`` or ``http-json``
    (Ray has HTTP only: binary when gRPC is asked for)."""
    ports: PortRange | None = None
    """Where every served runtime's ports are chosen (None: anywhere in 20000-32767)."""
    max_batch: int = 0
    """The most rows the model itself takes (0: it does not batch)."""

    @classmethod
    def of(cls, model: ModelConfig) -> Setup:
        """An image classifier gets one 320x240 JPEG per request, your own code one row of
        its signature's sample inputs (BYTES: ``b"x"``, not an image), any other model one
        row of random tensors (``payload_from_metadata``)."""
        from ..protocol.kserve import metadata
        from ..runtime.base import probe_model
        from .payload import payload_from_metadata

        probe = probe_model(model)
        most = probe.spec.max_batch_size
        if probe.image_spec is not None:
            payload = {"image": np.array([[synthetic_image(0)]], dtype=object)}
            return cls(model, image_model_name(model.name), payload, True, max_batch=most)
        if model.is_code:
            return cls(model, model.name, probe.spec.sample_inputs(1), False, max_batch=most)
        inputs = metadata(model.name, probe.spec)["inputs"]
        return cls(model, model.name, payload_from_metadata(inputs), False, max_batch=most)

    def local(self, threads: int | None = None) -> Any:
        """What the in-process rows call: the Pipeline (classifier) or the runner itself."""
        import dataclasses

        from ..pipeline import image_classifier
        from ..runtime.base import load_model_runner

        runner = load_model_runner(dataclasses.replace(self.model, threads=threads))
        return image_classifier(runner, top_k=self.model.top_k) if self.image else runner


Totals = tuple[float, float, float, float, float]
"""A model's own statistics so far: requests answered, then the count and microseconds
of its queue entries and of its compute entries (Triton's counts: per request in
tritonserver, per execution in servekit's Batcher, so each mean is a request's wait, or
the compute of the batch it rode in)."""


@dataclass(frozen=True)
class Targets:
    """Makes a runtime's load-generator target (inside the measuring loop) and reads the
    model's own statistics (``totals``: None where the runtime keeps none)."""

    make: Callable[[], Any]
    totals: Callable[[], Totals | None] = lambda: None

    def __call__(self) -> Any:
        return self.make()


def _served_totals(http_url: str, model: str) -> Totals | None:
    """Triton's statistics extension (``/v2/models/<m>/stats``): every runtime that serves
    it; None where it is not served."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"]
    except (OSError, ValueError, KeyError):
        return None
    out = [0.0] * 5
    for s in stats:
        i = s.get("inference_stats", {})
        out[0] += float(i.get("success", {}).get("count", 0))
        out[1] += float(i.get("queue", {}).get("count", 0))
        out[2] += float(i.get("queue", {}).get("ns", 0)) / 1e3
        out[3] += float(i.get("compute_infer", {}).get("count", 0))
        out[4] += sum(float(i.get(k, {}).get("ns", 0)) / 1e3
                      for k in ("compute_input", "compute_infer", "compute_output"))  # fmt: skip
    return out[0], out[1], out[2], out[3], out[4]


@contextlib.contextmanager
def _raw(setup: Setup) -> Iterator[Any]:
    local = setup.local()
    try:
        yield Targets(lambda: RunnerTarget(local, setup.payload, threads=16, name="raw")), None
    finally:
        local.close()


@contextlib.contextmanager
def _batcher(setup: Setup) -> Iterator[Any]:
    m = setup.model
    local = setup.local(m.threads)
    batcher = Batcher(local, m.batching, instance_count=m.instances, name=setup.target)

    def totals() -> Totals:
        s = batcher.stats.snapshot()
        ok, runs = float(s.request_success), float(s.execution_count)
        return ok, ok, float(s.queue_us), runs, float(s.compute_us)

    try:
        yield Targets(lambda: BatcherTarget(batcher, setup.payload), totals), None
    finally:
        batcher.close()
        local.close()


def _served(runtime: str, ray: RayOptions | None = None) -> Callable[[Setup], Any]:
    """``servekit serve --runtime RUNTIME`` in its own process, from the same ``ServeConfig``
    on loopback, so its process tree's CPU is its own; the targets speak gRPC where the
    runtime has it, HTTP otherwise. On Ray, half a CPU per model replica (``ray``)."""
    if ray is None:
        ray = RayOptions(model_cpus=0.5) if runtime == "ray" else RayOptions()

    @contextlib.contextmanager
    def served(setup: Setup) -> Iterator[Any]:
        config = ServeConfig(
            (setup.model,), ServerConfig(exit_timeout_s=2), runtime=runtime, ray=ray
        ).on_loopback(setup.ports)
        url = target_url(config, setup.protocol)
        binary = setup.protocol != "http-json"
        with ServerProcess(config) as server:
            server.wait_ready([setup.target])
            yield (
                Targets(
                    lambda: open_target(url, setup.target, setup.payload, binary=binary),
                    lambda: _served_totals(config.server.http_url, setup.target),
                ),
                server.pid,
            )

    return served


PROTOCOLS = ("grpc", "http-binary", "http-json")


def target_url(config: ServeConfig, protocol: str = "grpc") -> str:
    """Where the load goes: the runtime's gRPC port (HTTP for Ray, its only one) or its
    HTTP port."""
    if protocol == "grpc" and config.runtime != "ray":
        return config.server.grpc_url
    return config.server.http_url


def pipeline_ceiling(setup: Setup, seconds: float = 5.0) -> tuple[float, dict[int, float]]:
    """The in-process model's best rows/s over batch sizes 1, 8, 16 (those the model
    takes) and its max batch size (no server at all):
    the Pipeline for a classifier, the runner otherwise."""
    local = setup.local()
    by_batch: dict[int, float] = {}
    try:
        most = max(local.spec.max_batch_size, 1)
        for batch in sorted({b for b in (1, 8, 16) if b <= most} | {most}):
            rows = {k: np.concatenate([v] * batch) for k, v in setup.payload.items()}
            by_batch[batch] = rows_per_s(lambda: local.infer(rows), batch, seconds)  # noqa: B023 - called before the loop moves on
    finally:
        local.close()
    return max(by_batch.values()), by_batch


class _Skip(Exception):
    """A runtime that cannot run here, with the reason."""


def _needs(module: str, extra: str) -> Callable[[Callable[[Setup], Any]], Callable[[Setup], Any]]:
    def wrap(factory: Callable[[Setup], Any]) -> Callable[[Setup], Any]:
        def checked(setup: Setup) -> Any:
            try:
                __import__(module)
            except ImportError:
                raise _Skip(
                    f"{module} is not installed (pip install 'servekit[{extra}]')"
                ) from None
            return factory(setup)

        return checked

    return wrap


RUNTIMES: dict[str, Callable[[Setup], Any]] = {
    "raw": _raw,
    "batcher": _batcher,
    "native": _needs("uvicorn", "http")(_served("native")),
    "pytriton": _needs("pytriton", "triton")(_served("pytriton")),
    "triton": _needs("pytriton", "triton")(_served("triton")),
    "ray": _needs("ray", "ray")(_served("ray")),
    "ray-direct": _needs("ray", "ray")(_served("ray", RayOptions(model_cpus=0.5, direct=True))),
    "ray-direct-fused": _needs("ray", "ray")(
        _served("ray", RayOptions(model_cpus=1.0, direct=True, fuse=True))
    ),
}
"""Runtime name -> context manager yielding a target factory. ``raw`` is the in-process
Pipeline called one image per request from concurrent threads (no batching, no server);
``batcher`` servekit's Batcher in front of it, in-process; the others are ``servekit serve
--runtime NAME`` (``triton``: the repository's ensemble on the servekit backend;
``ray-direct``: Ray with ``[ray] direct``; ``ray-direct-fused``: with ``fuse`` too, the
models in the ingress replica)."""


@dataclass
class ComparisonResult:
    rounds: dict[str, list[list[Point]]]
    """Runtime -> each round's points, one per level, in the order measured."""
    skipped: dict[str, str]
    ceiling: float | None = None
    """The in-process Pipeline's best images/s at its best batch size: the raw ceiling."""
    ceiling_by_batch: dict[int, float] | None = None
    workload: str = ""
    """What each request is, in words (for the report)."""
    model: str = ""
    """The model served, as the report and the plot name it."""
    policies: dict[str, str] = dataclasses.field(default_factory=dict)
    """Runtime -> its effective policy (batch size, delay or budget, instances, threads)."""
    notes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Runtime -> what of the policy it cannot honour, and what it does instead."""
    time_spent: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Runtime -> microseconds: ``queue`` (a request's mean wait) and ``compute`` (the
    mean compute of the batch a request rode in), the model's own statistics, and
    ``CPU: <process>``, its process tree's CPU per request answered, by process."""

    @property
    def series(self) -> dict[str, list[Point]]:
        """Each runtime's points, at each level the round of median throughput (a point
        measured as it is, not a mean of several)."""
        out = {}
        for name, rounds in self.rounds.items():
            out[name] = [
                sorted(at, key=lambda p: p.stats.inferences_per_s)[(len(at) - 1) // 2]
                for at in zip(*rounds, strict=True)
            ]
        return out

    def share_of_raw(self) -> dict[str, float]:
        """Each runtime's best inferences/s as a fraction of the raw ceiling (or raw's
        best); empty when neither was measured."""
        series = self.series
        if self.ceiling:
            raw = self.ceiling
        elif "raw" in series:
            raw = max(p.stats.inferences_per_s for p in series["raw"])
        else:
            return {}
        return {
            name: max(p.stats.inferences_per_s for p in pts) / raw for name, pts in series.items()
        }


def effective_policy(setup: Setup, runtime: str) -> tuple[str, list[str]]:
    """What ``runtime`` does with the setup's policy, in words, and what it cannot honour."""
    from ..config import ServeConfig
    from ..runtime.base import static_budgets

    m = setup.model
    threads = f"{m.threads} ORT thread(s) an instance" if m.threads else "ORT's default threads"
    if runtime == "raw":
        return f"no batching, no server: one request a call from 16 threads, {threads}", [
            "`raw` calls the model directly: the policy's batching and instances do not apply"
        ]
    b = m.batching
    rows = b.effective_max_batch_size(setup.max_batch)
    wait = (
        f"latency budget {b.latency_budget_ms:g} ms at p{b.latency_percentile:g}"
        if b.latency_budget_ms
        else f"max_queue_delay_us {b.max_queue_delay_us}"
    )
    preferred = f", preferred {list(b.preferred_batch_sizes)}" if b.preferred_batch_sizes else ""
    text = f"max_batch_size {rows}{preferred}, {wait}, {m.instances} instance(s), {threads}"
    notes = []
    if runtime in ("pytriton", "triton"):
        notes = static_budgets(ServeConfig((m,), runtime=runtime))
    if runtime.startswith("ray"):
        notes.append(f"{runtime}: each model replica reserves {_RAY_CPUS[runtime]:g} Ray CPU")
    return text, notes


_RAY_CPUS = {"ray": 0.5, "ray-direct": 0.5, "ray-direct-fused": 1.0}


def compare(
    model: ModelConfig,
    runtimes: Sequence[str],
    levels: Sequence[float],
    cfg: MeasureConfig,
    *,
    on_event: Callable[[str], None] = lambda _: None,
    ceiling_seconds: float = 0.0,
    protocol: str = "grpc",
    ports: PortRange | None = None,
    rounds: int = 1,
) -> ComparisonResult:
    """Start every runtime, each serving ``model`` (an image classifier: its image model
    takes the load), then run the same closed-loop sweep against each in turn, ``rounds``
    times, the runtimes interleaved (A B C, B C A, ...) so a drift of the machine falls on
    all of them; with ``ceiling_seconds``, first measure the in-process Pipeline's best
    batched throughput as the raw ceiling. Every port a served runtime opens is chosen in
    ``ports`` (a range), where one is given."""
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ValueError(f"unknown runtime(s) {unknown}; choose from {list(RUNTIMES)}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {list(PROTOCOLS)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    setup = dataclasses.replace(Setup.of(model), protocol=protocol, ports=ports)
    result = ComparisonResult({}, {}, workload=_workload(setup), model=model.name)
    if ceiling_seconds > 0:
        on_event("measuring the raw ceiling (in-process, batch 1/8/16/max)")
        result.ceiling, result.ceiling_by_batch = pipeline_ceiling(setup, ceiling_seconds)
    with contextlib.ExitStack() as stack:
        started: dict[str, tuple[Targets, int | None]] = {}
        for name in runtimes:
            try:
                context = RUNTIMES[name](setup)
            except _Skip as exc:
                result.skipped[name] = str(exc)
                on_event(f"skipped {name}: {exc}")
                continue
            on_event(f"starting {name}")
            started[name] = stack.enter_context(context)
            result.policies[name], result.notes[name] = effective_policy(setup, name)
            result.rounds[name] = []
        sums: dict[str, list[float]] = {name: [0.0] * 4 for name in started}
        cpu: dict[str, dict[str, float]] = {name: {} for name in started}
        names = list(started)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
                targets, pid = started[name]
                on_event(f"round {r + 1}/{rounds}: measuring {name}")
                before, cpu_before = targets.totals(), tree_cpu_by_title(pid) if pid else {}
                measure = dataclasses.replace(cfg, server_pid=pid)

                async def run(targets: Any = targets, measure: Any = measure) -> list[Point]:
                    target = targets()  # inside the loop: asyncio clients bind to it
                    try:
                        return await sweep(target, levels, "concurrency", measure)
                    finally:
                        await target.close()

                result.rounds[name].append(asyncio.run(run()))
                after = targets.totals()
                if before is None or after is None or after[0] <= before[0]:
                    continue
                for k in range(4):
                    sums[name][k] += after[k + 1] - before[k + 1]
                if pid:  # over the same span as the statistics: warm-up, windows and all
                    for proc, seconds in tree_cpu_by_title(pid).items():
                        used = (seconds - cpu_before.get(proc, 0.0)) * 1e6
                        cpu[name][proc] = cpu[name].get(proc, 0.0) + used
                cpu[name][""] = cpu[name].get("", 0.0) + after[0] - before[0]
    for name, (queued, queue_us, runs, compute_us) in sums.items():
        if not queued:
            continue
        answered = cpu[name].pop("")
        result.time_spent[name] = {
            "queue": queue_us / queued,
            "compute": compute_us / runs if runs else 0.0,
            **{f"CPU: {proc}": us / answered for proc, us in cpu[name].items()},
        }
    return result


def _workload(setup: Setup) -> str:
    over = {
        "grpc": "Served runtimes are reached over gRPC (Ray over HTTP with binary tensors, its only port).",
        "http-binary": "Served runtimes are reached over HTTP with binary tensors.",
        "http-json": "Served runtimes are reached over HTTP with JSON tensors.",
    }[setup.protocol]
    return f"{_what(setup)} {over}"


def _what(setup: Setup) -> str:
    if setup.image:
        return (
            f"Every runtime classifies the same 320x240 JPEG (decode, resize, crop, normalise, "
            f"{setup.model.name}, top-{setup.model.top_k}) on `{setup.target}`, closed loop, one "
            "image per request, same policy."
        )
    shapes = ", ".join(f"{k} {v.dtype} {list(v.shape)}" for k, v in setup.payload.items())
    return (
        f"Every runtime serves `{setup.target}` with the same policy, closed loop, one request "
        f"of {shapes} at a time per client."
    )
