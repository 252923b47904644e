"""Shared fixtures: zoo models built once per session into a private cache."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from servekit import zoo

RAY = re.compile(r"(?<![a-z])ray", re.IGNORECASE)
"""A test id that names Ray (a ``test_ray_*`` module, a ``[ray]`` parameter, ``..._on_ray``)."""


def starts_ray(item: pytest.Item) -> bool:
    """Whether ``item`` starts Ray (its id names Ray, or it is marked ``ray``)."""
    return item.get_closest_marker("ray") is not None or bool(RAY.search(item.nodeid))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Two workers share the suite (``-n 2``, ``--dist loadgroup``): every test that starts
    Ray runs on one of them, one Ray at a time (Ray's processes, its netns hosts and
    ``ray stop`` are the machine's); every other module's tests stay together on one
    worker, so each module's servers start once."""
    for item in items:
        group = "ray" if starts_ray(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker stops at once if ``--dist loadgroup`` grouped nothing (pytest-xdist names a
    grouped test ``<id>@<group>``; under pytest 9 it cannot): modules would be split over
    both workers and two Ray tests run at once."""
    grouping = getattr(session.config.option, "loadgroup", False) and session.items
    if grouping and "@" not in session.items[0].nodeid:
        raise pytest.UsageError(
            f"--dist loadgroup grouped nothing (pytest {pytest.__version__}): "
            "install the versions pyproject.toml names"
        )


# ------------------------------------------------------------- one Ray a worker

_shared_ray = False
"""Whether this worker started the Ray its Ray tests share."""


def _stop_shared_ray() -> None:
    global _shared_ray
    if _shared_ray:
        import ray

        ray.shutdown()
        _shared_ray = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The Ray tests run on one local Ray (``address="local"``, 2 CPUs, no dashboard),
    started before the first and stopped after the last: a Ray start and stop costs about
    10 s here. Serve starts and stops with each test's server (``RayRuntime`` and
    ``ray_serve`` join a running Ray and leave it running). A test marked ``own_ray`` starts
    Ray itself (a subprocess's, a cluster's, one with its own environment): the shared one
    is stopped first."""
    global _shared_ray
    if not starts_ray(item) or item.get_closest_marker("own_ray") is not None:
        _stop_shared_ray()
        return
    with warnings.catch_warnings():  # Ray Serve's own import warns (pydantic): not ours
        warnings.simplefilter("ignore")
        import ray
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        _shared_ray = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the fixtures' teardown: the shared Ray stops once no Ray test follows."""
    if nextitem is None or not starts_ray(nextitem):
        _stop_shared_ray()


HAS_TORCH = importlib.util.find_spec("torch") is not None


def has_cuda() -> bool:
    """Whether PyTorch is installed and sees a CUDA GPU (the device; never CI)."""
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed (servekit[torch])")
needs_cuda = pytest.mark.skipif(not has_cuda(), reason="no CUDA GPU (PyTorch sees none)")


def wait_until(
    condition: Callable[[], object],
    what: str,
    timeout_s: float = 30.0,
    *,
    alive: Callable[[], object] | None = None,
) -> None:
    """Wait for ``condition()`` to hold (a state, never a fixed time); fail naming ``what``
    after ``timeout_s``, or at once when ``alive()`` says what we wait on has died. A
    condition that raises counts as not yet."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            if condition():
                return
        except Exception:
            pass
        assert alive is None or alive(), f"died while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def each_client(work: Callable[[int], None], clients: int = 8, timeout_s: float = 120) -> None:
    """Run ``work(k)`` for ``clients`` clients at once, each on a thread of its own (a
    tritonclient per thread: they are not thread-safe); fail naming every client whose
    work raised."""
    failures: list[tuple[int, str]] = []

    def run(k: int) -> None:
        try:
            work(k)
        except BaseException as exc:  # reported from the calling thread
            failures.append((k, f"{type(exc).__name__}: {exc}"))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a client did not finish"
    assert not failures, failures


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def resnet50_path(model_cache: Path) -> Path:
    return zoo.build("resnet50", model_cache)


@pytest.fixture(scope="session")
def tiny_cnn_path(model_cache: Path) -> Path:
    return zoo.build("tiny_cnn", model_cache)


@pytest.fixture(scope="session")
def add_sub_path(model_cache: Path) -> Path:
    return zoo.build("add_sub", model_cache)


@pytest.fixture
def devices():
    """Two stand-in CUDA devices (``cudamemory.Devices``: host bytes behind the interface
    of a buffer on a GPU), for the CUDA shared-memory tests that run without one."""
    from cudamemory import Devices

    return Devices()


@pytest.fixture
def regions(devices, tmp_path):
    """A ``SharedMemory`` registry whose CUDA regions open on ``devices``."""
    from servekit.protocol.shm import SharedMemory

    shm = SharedMemory(str(tmp_path), open_cuda=devices.open)
    yield shm
    shm.close()


def free_port() -> int:
    """A loopback port nothing listens on (re-exported for the test modules)."""
    from servekit.endpoints import free_port as _free

    return _free()


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """A Prometheus exposition's samples, keyed by (name as exposed, labels); parsed by
    prometheus_client, so a malformed exposition fails the test too."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # The parser names counter samples the OpenMetrics way (``_total``); Triton's
            # and servekit's exposition do not.
            name = s.name.removesuffix("_total") if family.type == "counter" else s.name
            out[(name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """GET a metrics endpoint and parse it (``parse_metrics``)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return parse_metrics(r.read().decode())


def sample(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as a counter that never moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """An ASGI app under a real uvicorn on a free loopback port; yields its base URL and
    always stops the server, also when the test fails."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "uvicorn listening", 20)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class Load:
    """Threads calling the model until stopped, each with what ``session(k)`` opens for it
    (a client, since tritonclient's are per thread); keeps every result or exception."""

    def __init__(
        self, session: Callable[[int], contextlib.AbstractContextManager], threads: int = 4
    ) -> None:
        self.results: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers = [
            threading.Thread(target=self._loop, args=(session, k)) for k in range(threads)
        ]

    def _loop(self, session: Callable[[int], contextlib.AbstractContextManager], k: int) -> None:
        with session(k) as call:
            while not self._stop.is_set():
                try:
                    out = call()
                except Exception as exc:
                    out = exc
                with self._lock:
                    self.results.append(out)

    def __enter__(self) -> Load:
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(60)

    def failures(self) -> list[Exception]:
        return [r for r in self.results if isinstance(r, Exception)]

    def wait_answers(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` more calls have come back (answers or errors)."""
        target = len(self.results) + count
        wait_until(lambda: len(self.results) >= target, f"{count} more answers", timeout_s)


@contextlib.contextmanager
def ray_serve() -> Iterator[str]:
    """Serve's HTTP proxy on a free loopback port, on the worker's shared Ray (started
    before every Ray test, ``pytest_runtest_setup``); yields its URL and always shuts
    Serve down."""
    with warnings.catch_warnings():  # Ray Serve's own import warns (pydantic): not ours
        warnings.simplefilter("ignore")
        import ray
        from ray import serve

    assert ray.is_initialized(), "ray_serve runs in a Ray test (its id names Ray)"
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def served_models(
    source,
    *,
    name: str = "",
    policy=None,
    instances: int = 1,
    threads: int | None = None,
):
    """``load_models`` for one model file: the tensor model and, for classifiers, its image model."""
    from servekit import BatchingPolicy, ModelConfig
    from servekit.runtime import load_models

    model = ModelConfig(
        str(source), name, batching=policy or BatchingPolicy(), instances=instances, threads=threads
    )
    return load_models(model)


def metered_bytes(path: Path) -> int:
    """What the model store charges the ONNX file at ``path`` (``servekit.store.Meter``:
    measured alone, in a helper process)."""
    from servekit import ModelConfig
    from servekit.store import Meter

    with Meter() as meter:
        charge = meter.charge(ModelConfig(str(path), path.stem, image=False), str(path))
    assert charge is not None, f"the meter could not measure {path}"
    return charge


def terminate(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM, as Kubernetes sends it; SIGKILL if ``proc`` has not exited within
    ``timeout_s``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Served:
    host: str
    http_port: int
    grpc_port: int | None
    triton_metrics: str | None = None
    """Triton's own metrics (the Triton runtimes): each version's ``nv_inference_*``."""
    pytriton: bool = False

    def version_labels(self, version: str) -> dict[str, str]:
        """Where ``nv_inference_*`` counts version ``version`` of m: PyTriton serves it as
        its own Triton model ``m.v<N>`` (``version_model_name``)."""
        if self.pytriton and version != "1":
            return {"model": f"m.v{version}", "version": "1"}
        return {"model": "m", "version": version}

    @property
    def metrics_url(self) -> str:
        """Where this server's ``nv_inference_*`` are scraped."""
        return self.triton_metrics or f"http://{self.host}:{self.http_port}/metrics"

    def pending(self, model: str, version: str = "1") -> float | None:
        """``model``'s pending-request gauge now (None if the server exports none: a check
        that it is 0 then fails)."""
        key = ("nv_inference_pending_request_count",
               frozenset({("model", model), ("version", version)}))  # fmt: skip
        return scrape(self.metrics_url).get(key)


def on(runtime: str, store: Any = None):
    """Serve one model with servekit's runtime ``runtime`` on loopback ports (beside the
    models of ``store``, where one is given)."""

    @contextlib.contextmanager
    def serve_on(model: Any, **server: Any) -> Iterator[Served]:
        from servekit import ServeConfig, ServerConfig
        from servekit.config import StoreConfig
        from servekit.serving import create_runtime

        config = ServeConfig(
            (model,), ServerConfig(exit_timeout_s=2, **server), runtime=runtime,
            store=store or StoreConfig(),
        ).on_loopback()  # fmt: skip
        served = create_runtime(config)
        served.start()
        try:
            s = config.server
            metrics = None if runtime == "native" else s.metrics_url
            yield Served("127.0.0.1", s.http_port, s.grpc_port, metrics, runtime == "pytriton")
        finally:
            served.stop()

    return serve_on


@contextlib.contextmanager
def supervised(runtime: Any) -> Iterator[Any]:
    """``runtime`` started and watched by a Supervisor on a thread (restarts at once)."""
    from servekit.runtime.supervisor import Supervisor

    events: list[str] = []
    supervisor = Supervisor(
        runtime, max_restarts=20, check_s=0.2, backoff_s=0.05, max_backoff_s=0.2,
        on_event=events.append,
    )  # fmt: skip
    supervisor.events = events  # type: ignore[attr-defined]
    thread = threading.Thread(target=supervisor.run, name="supervisor", daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        supervisor.request_stop()
        thread.join(60)


@pytest.fixture(autouse=True)
def forget_lost_device() -> Iterator[None]:
    """A test that stands in a device raising CUDA's sticky words in this process loses
    the process's device (``servekit.cuda.lost``): forgotten after it, so the next test's
    server is live."""
    from servekit import cuda

    with cuda.lost_within():
        yield


@pytest.fixture
def fake_cuda() -> Iterator[Any]:
    """The model of a GPU (``fakecuda``) as the process's CUDA for the test; nothing it saw
    may be left unreported when the test ends."""
    import gc

    from fakecuda import FakeCuda
    from servekit import cuda

    device = FakeCuda()
    with cuda.use(device):
        yield device
        gc.collect()
        device.check()
    device.close()
    assert device.problems == [], device.problems


@pytest.fixture(scope="module")
def ray_url() -> Iterator[str]:
    """A Ray Serve instance for the module's tests (skipped without the ray extra)."""
    pytest.importorskip("ray", reason="needs the ray extra")
    with ray_serve() as url:
        yield url


@contextlib.contextmanager
def on_ray(url: str, model: Any, store: Any = None, **server: Any) -> Iterator[Served]:
    with warnings.catch_warnings():  # Ray Serve's own import warns (pydantic): not ours
        warnings.simplefilter("ignore")
        from ray import serve

        from servekit.ray import build_app
    from servekit import RayOptions, ServeConfig, ServerConfig
    from servekit.client import Client
    from servekit.config import StoreConfig

    config = ServeConfig(
        (model,), ServerConfig(**server), runtime="ray", ray=RayOptions(model_cpus=0.5),
        store=store or StoreConfig(),
    )  # fmt: skip
    serve.run(build_app(config), name="servekit", route_prefix="/")
    with Client(url) as c:  # a stored model is ready once loaded: the server, then
        c.wait_ready(None if config.store.active else model.name, timeout_s=120)
    try:
        yield Served("127.0.0.1", int(url.rsplit(":", 1)[1]), None)
    finally:
        serve.delete("servekit")


@contextlib.contextmanager
def started(config: Any) -> Iterator[Any]:
    """``config``'s runtime (``create_runtime``) started, and always stopped."""
    from servekit.serving import create_runtime

    runtime = create_runtime(config)
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()


def needs_runtime(runtime: str) -> None:
    """Skip, naming the extra, where ``runtime`` is not installed; Ray Serve imported once
    with its own import warnings (pydantic's) silenced, as they are not ours."""
    if runtime in ("pytriton", "triton"):
        pytest.importorskip("pytriton", reason="needs the triton extra (its tritonserver)")
    if runtime == "ray":
        pytest.importorskip("ray", reason="needs the ray extra")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from ray import serve  # noqa: F401


def serve_on_runtime(request: Any, runtime: str) -> Any:
    """``serve(model, **server)`` on servekit's runtime ``runtime``, a context manager that
    yields ``Served`` (Ray: on the module's ``ray_url``)."""
    if runtime in ("pytriton", "triton"):
        pytest.importorskip("pytriton", reason="needs the triton extra")
    if runtime != "ray":
        return on(runtime)
    url = request.getfixturevalue("ray_url")
    return lambda model, **server: on_ray(url, model, **server)


# ------------------------------------------------------------- Redis, a real one

REDIS = shutil.which("redis-server")


@pytest.fixture
def redis_server():
    """A real redis-server (Debian's) on a free loopback port; yields its URL, ``stop``
    and ``start`` (again, on the same port); always stopped."""
    if REDIS is None:
        pytest.skip("needs redis-server (apt-get install redis-server)")
    port = free_port()
    procs: list[subprocess.Popen] = []

    def start() -> None:
        procs.append(subprocess.Popen(
            [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        ))  # fmt: skip

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, "redis-server listening", 20)

    def stop() -> None:
        procs[-1].kill()
        procs[-1].wait(10)

    start()
    try:
        yield f"redis://127.0.0.1:{port}/0", stop, start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def cancelled_first(answer: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A coroutine batch function whose first call awaits a call that its owner cancels
    under it (as Ray does a handle call made under a request it cancels); later calls
    return ``answer(inputs)``."""
    calls = 0

    async def owned_elsewhere(inputs: Any) -> Any:
        nonlocal calls
        calls += 1
        call = asyncio.get_running_loop().create_future()
        if calls == 1:
            asyncio.get_running_loop().call_soon(call.cancel)
        else:
            call.set_result(None)
        await call
        return answer(inputs)

    return owned_elsewhere
