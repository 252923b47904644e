"""Work nobody waits for is never done (issue 71): a request whose client left is dropped
from its queue and never reaches the device; one already in a running batch finishes and
its answer is dropped; each is counted once in ``servekit_requests_abandoned_total``.

The property runs the Batcher in-process; the served tests use real clients over loopback
against native's own HTTP/1.1 and gRPC servers and through servekit's front on pytriton
and triton (its window, ``front.window``): raw sockets that close or reset, tritonclient's
gRPC cancel, stream cancel and deadline, and the KServe ``timeout`` parameter. The device
is simulated (``SimulatedDevice``), or a model that waits while a file exists: its rows
are the model's own ``nv_inference_count``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import each_client, on, sample, scrape, wait_until
from servekit import Batcher, BatchingPolicy, ModelConfig, ModelSpec, QueuePolicy, TensorSpec, zoo
from servekit.bench.payload import raw_http_infer
from servekit.zoo.tiny import build_simulated

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

# ------------------------------------------------------------------ the Batcher's property

SPEC = ModelSpec((TensorSpec("x", np.float32, [1]),), (TensorSpec("y", np.float32, [1]),), 64)


async def _run_case(rows: list[int], cancel: list[bool], limit: int) -> None:
    batches: list[list[int]] = []
    gate = asyncio.Event()

    async def fn(inputs):
        batches.append([int(v) for v in inputs["x"][:, 0]])
        await gate.wait()
        return {"y": inputs["x"] * 2}

    batcher = Batcher(fn, BatchingPolicy(max_batch_size=limit), spec=SPEC, name="p")
    xs = [np.full((min(r, limit), 1), i, np.float32) for i, r in enumerate(rows)]
    tasks = [asyncio.ensure_future(batcher.infer({"x": xs[0]}))]
    await asyncio.sleep(0)  # the first runs at once and holds the only instance
    tasks += [asyncio.ensure_future(batcher.infer({"x": x})) for x in xs[1:]]
    for _ in range(3):
        await asyncio.sleep(0)  # every request admitted and queued
    for task, leave in zip(tasks, cancel, strict=True):
        if leave:
            task.cancel()
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await batcher.aclose()

    ran = [i for batch in batches for i in dict.fromkeys(batch)]
    assert ran[0] == 0 and len(ran) == len(set(ran)), batches  # nobody runs twice
    for i, (result, leave) in enumerate(zip(results, cancel, strict=True)):
        if leave:
            assert isinstance(result, asyncio.CancelledError)
            assert i == 0 or i not in ran, f"request {i} left before its batch, yet ran"
        else:
            assert isinstance(result, dict), result
            np.testing.assert_array_equal(result["y"], xs[i] * 2)
            assert i in ran
    s = batcher.stats
    assert s.abandoned_running == int(cancel[0])
    assert s.abandoned_queued == sum(cancel[1:])
    assert s.request_cancelled == sum(cancel)
    assert s.inference_count == sum(len(xs[i]) for i in ran)


case = st.integers(1, 8).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(1, 4), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.integers(1, 8),
    )
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case)
def test_a_request_cancelled_before_its_batch_forms_never_runs_and_the_rest_answer_once(c):
    rows, cancel, limit = c
    asyncio.run(_run_case(rows, cancel, limit))


# -------------------------------------------------------------------- native, served

SLOW_S = 0.3
"""The slow device's batch: long enough that requests queue behind it on a busy machine."""


@pytest.fixture(scope="module")
def slow_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("abandoned") / "slow.onnx"
    onnx.save(build_simulated("abandoned-slow", SLOW_S * 1e6, 0), path)
    return path


@pytest.fixture(scope="module")
def sim_path(model_cache):
    return zoo.build("sim_t4", model_cache)


def figures(url: str) -> dict[str, float]:
    """The model's figures at ``url`` (a server's base URL, or its ``.../metrics``)."""
    s = scrape(url if url.endswith("/metrics") else f"{url}/metrics")
    labels = {"model": "m", "version": "1"}
    out = {
        name: sample(s, name, **labels)
        for name in (
            "nv_inference_count", "nv_inference_request_success",
            "nv_inference_pending_request_count",
        )
    }  # fmt: skip
    for where in ("queued", "running", "forwarded"):
        out[where] = sample(s, "servekit_requests_abandoned", **labels, where=where)
    return out


def settled(url: str, clients: int) -> dict[str, float]:
    """The figures once every client's request is answered or counted abandoned."""
    got: dict[str, float] = {}

    def done() -> bool:
        # Those abandoned running (or forwarded) are answered, and the answers dropped.
        got.update(figures(url))
        return got["nv_inference_request_success"] + got["queued"] >= clients

    try:
        wait_until(done, f"{clients} requests answered or abandoned", 30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last figures: {got}") from None
    return got


NAME = {(64, 64, 3): "input", (16,): "INPUT0"}


def http_request(x: np.ndarray, parameters: dict | None = None) -> bytes:
    """A KServe v2 binary request of model m for ``x`` (its ``INPUT0`` or ``input``)."""
    return raw_http_infer("m", {NAME[x.shape[1:]]: x}, parameters)


def leave(port: int, clients: int, x: np.ndarray, wait_s: float = 0.03) -> None:
    """``clients`` connections each send one request and leave ``wait_s`` later without
    reading: half close, half reset (linger 0), as clients with a timeout do."""
    request = http_request(x)
    open_: list[tuple[float, socket.socket]] = []

    def close_due(now: float) -> None:
        while open_ and open_[0][0] <= now:
            s = open_.pop(0)[1]
            if len(open_) % 2:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()

    for _ in range(clients):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        open_.append((time.monotonic() + wait_s, s))
        close_due(time.monotonic())
    while open_:
        time.sleep(max(0.0, open_[0][0] - time.monotonic()))
        close_due(time.monotonic())


def native_model(path, **queue) -> ModelConfig:
    policy = BatchingPolicy(max_batch_size=32, default_queue_policy=QueuePolicy(**queue))
    return ModelConfig(str(path), "m", batching=policy)


def test_sim_t4_clients_that_close_after_30_ms_cost_at_most_two_batches(sim_path):
    """The issue's run, smaller: 120 clients of sim_t4 (max batch 32) leave after 30 ms;
    the device runs at most two batches' rows, and every request is answered or counted."""
    clients = 120
    with on("native")(native_model(sim_path)) as served:
        url = f"http://127.0.0.1:{served.http_port}"
        leave(served.http_port, clients, np.zeros((1, 64, 64, 3), np.float32))
        got = settled(url, clients)
        assert got["nv_inference_count"] <= 64, got
        assert got["queued"] >= clients - 64, got
        assert got["nv_inference_pending_request_count"] == 0


@pytest.fixture(scope="module")
def slower_path(tmp_path_factory):
    """A batch of a second: no forwarded request comes back before every client of the
    test below has left, however slowly a loaded machine sends them."""
    path = tmp_path_factory.mktemp("abandoned") / "slower.onnx"
    onnx.save(build_simulated("abandoned-slower", 1e6, 0), path)
    return path


@pytest.mark.parametrize("runtime", ["pytriton", "triton"])
def test_the_fronts_forward_two_batches_at_a_time_and_drop_the_rest_when_clients_leave(
    runtime, slower_path
):
    """120 clients of a device whose batch takes 1 s (max batch 32) leave after 30 ms:
    servekit's front has forwarded two full batches (its window, ``front.window``), which
    tritonserver runs for nobody (``where="forwarded"``); the other 56 waited in the front
    and are dropped unsent (``where="queued"``)."""
    clients = 120
    with on(runtime)(native_model(slower_path)) as served:
        assert served.triton_metrics is not None
        leave(served.http_port, clients, np.zeros((1, 16), np.float32))
        got = settled(served.triton_metrics, clients)
        assert got["nv_inference_count"] <= 64, got
        assert got["queued"] >= clients - 64, got
        assert got["queued"] + got["forwarded"] == clients, got
        assert got["nv_inference_pending_request_count"] == 0


def _occupy(port: int) -> socket.socket:
    """One request that holds the slow device (answered later, read by nobody)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(http_request(np.zeros((1, 16), np.float32)))
    return s


@pytest.fixture(scope="module")
def slow(slow_path):
    with on("native")(native_model(slow_path, allow_timeout_override=True)) as served:
        yield served


@contextlib.contextmanager
def held_grpc(slow) -> Iterator[tuple[str, dict[str, float], Any, Any]]:
    """The slow device held by one request, a gRPC client beside it and one request's
    input: (metrics url, the figures before, client, input); all closed after."""
    url = f"http://127.0.0.1:{slow.http_port}"
    before = figures(url)
    holder = _occupy(slow.http_port)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{slow.grpc_port}")
    try:
        x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(np.ones((1, 16), np.float32))
        yield url, before, client, x
    finally:
        client.close()
        holder.close()


def _rows_after(url: str, before: dict[str, float], clients: int) -> dict[str, float]:
    seen = before["nv_inference_request_success"] + before["queued"]
    got = settled(url, clients + seen)
    return {k: got[k] - before[k] for k in got}


def test_grpc_calls_cancelled_by_the_client_never_reach_the_device(slow):
    with held_grpc(slow) as (url, before, client, x):
        answers: list = []
        calls = [
            client.async_infer("m", [x], lambda r, e: answers.append((r, e))) for _ in range(6)
        ]
        wait_until(lambda: figures(url)["nv_inference_pending_request_count"] == 6, "6 queued")
        for call in calls:
            call.cancel()  # RST_STREAM
        got = _rows_after(url, before, 7)
    assert got["nv_inference_count"] == 1, got  # the holder's row only
    assert got["queued"] == 6, got


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_cancelled_grpc_stream_takes_its_queued_requests_with_it(slow):
    # tritonclient's own stream thread raises on the CANCELLED it asked for: not ours.
    with held_grpc(slow) as (url, before, client, x):
        client.start_stream(lambda r, e: None)
        for _ in range(5):
            client.async_stream_infer("m", [x])
        wait_until(lambda: figures(url)["nv_inference_pending_request_count"] == 5, "5 queued")
        client.stop_stream(cancel_requests=True)
        got = _rows_after(url, before, 6)
    assert got["nv_inference_count"] == 1, got
    assert got["queued"] == 5, got


def test_a_grpc_deadline_that_passes_in_the_queue_drops_the_request(slow):
    with held_grpc(slow) as (url, before, client, x):
        time.sleep(0.1)  # the holder reaches the device first
        with pytest.raises(Exception, match="(?i)deadline"):
            client.infer("m", [x], client_timeout=0.05)  # grpc-timeout: 50 ms
        got = _rows_after(url, before, 2)
    assert got["nv_inference_count"] == 1, got
    assert got["queued"] == 1, got


def test_the_kserve_timeout_parameter_drops_a_request_that_waits_past_it(slow):
    """``timeout`` (microseconds, honoured with ``allow_timeout_override`` as Triton does):
    timed out in the queue, the request fails (504) and never runs."""
    url = f"http://127.0.0.1:{slow.http_port}"
    before = figures(url)
    holder = _occupy(slow.http_port)
    try:
        time.sleep(0.1)  # the holder reaches the device first
        client = httpclient.InferenceServerClient(f"127.0.0.1:{slow.http_port}")
        x = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(np.ones((1, 16), np.float32))
        with pytest.raises(Exception, match="(?i)timed out"):
            client.infer("m", [x], timeout=50_000)
        client.close()
        wait_until(lambda: figures(url)["nv_inference_request_success"]
                   > before["nv_inference_request_success"], "the holder answered")  # fmt: skip
    finally:
        holder.close()
    got = {k: v - before[k] for k, v in figures(url).items()}
    assert got["nv_inference_count"] == 1, got


def _timed_out(metrics: str) -> float:
    return sample(scrape(metrics), "servekit_requests_timed_out", model="m", version="1")


def _waiting(metrics: str) -> float:
    return sample(scrape(metrics), "servekit_front_waiting_requests", model="m", version="1")


def _until_waiting(metrics: str, n: int, what: str) -> None:
    """Wait until ``n`` requests wait in the front; a failure says what was seen."""
    seen: list[float] = []

    def check() -> bool:
        seen.append(_waiting(metrics))
        return seen[-1] == n

    try:
        wait_until(check, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; waiting seen {seen[-8:]}; {figures(metrics)}") from None


HELD = """
import os
import time

import servekit


class Held(servekit.Model):
    \"\"\"A device the test holds busy: a batch waits while the file HOLD exists.\"\"\"

    inputs = [("INPUT0", "FP32", [16])]
    outputs = [("OUTPUT0", "FP32", [16])]
    max_batch_size = 2

    def infer(self, batch):
        if os.path.exists(HOLD):
            with open(HOLD + ".entered", "a") as f:
                f.write(f"{len(batch['INPUT0'])}\\n")
        while os.path.exists(HOLD):
            time.sleep(0.01)
        return {"OUTPUT0": batch["INPUT0"]}
"""


@dataclasses.dataclass(frozen=True)
class HeldDevice:
    """A ``Held`` model being served: its ports, metrics and hold file."""

    port: int
    grpc_port: int | None
    metrics: str
    """Where its ``nv_inference_*`` are read."""
    hold: Path
    """The device is held while this file exists."""

    def entered(self) -> list[int]:
        """The rows of each batch that reached the model while it was held."""
        with contextlib.suppress(FileNotFoundError):
            return [int(n) for n in Path(f"{self.hold}.entered").read_text().split()]
        return []


@contextlib.contextmanager
def held_device(
    runtime: str, tmp_path: Path, policy: BatchingPolicy | None = None, *, direct: bool = False
) -> Iterator[HeldDevice]:
    """``Held`` served as m on ``runtime`` (pytriton, triton, or ray: through Ray's proxy
    or ``[ray] direct``) and answered once; the device let go after, whatever happens."""
    hold = tmp_path / "hold"
    module = f"held_{uuid.uuid4().hex}"  # pytriton imports it here: one module per test
    (tmp_path / f"{module}.py").write_text(f"HOLD = {str(hold)!r}\n" + HELD)
    model = ModelConfig(
        f"{module}:Held", "m", path=str(tmp_path), batching=policy or BatchingPolicy()
    )
    with contextlib.ExitStack() as stack:
        if runtime == "ray":
            pytest.importorskip("ray.serve", reason="needs the ray extra")
            from servekit import RayOptions, ServeConfig, ServerConfig
            from servekit.ray.runtime import RayRuntime

            config = ServeConfig(
                (model,), ServerConfig(exit_timeout_s=2), runtime="ray",
                ray=RayOptions(model_cpus=0.5, direct=direct),
            ).on_loopback()  # fmt: skip
            stack.enter_context(RayRuntime(config, num_cpus=2))
            url = f"http://127.0.0.1:{config.server.http_port}"
            wait_until(lambda: figures(url), "the app's metrics", 60)
            held = HeldDevice(config.server.http_port, None, url, hold)
        else:
            served = stack.enter_context(on(runtime)(model))
            assert served.triton_metrics is not None
            held = HeldDevice(served.http_port, served.grpc_port, served.triton_metrics, hold)
        stack.callback(hold.unlink, missing_ok=True)  # before the server stops
        with contextlib.closing(_occupy(held.port)) as first:  # each later one enters at once
            assert answered(first).startswith(b"HTTP/1.1 200"), "the first answer"
        yield held


def answered(s: socket.socket) -> bytes:
    """All ``s``'s HTTP/1.1 answer to one request (its head and its ``content-length``)."""
    s.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise EOFError(f"closed before its answer came whole: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(
        line.split(b":", 1)[1] for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ))  # fmt: skip
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("runtime", ["pytriton", "triton"])
def test_through_the_fronts_grpc_cancels_stream_cancels_and_deadlines_leave_unsent(
    runtime, tmp_path
):
    """The window full (max batch 2: four requests with tritonserver, the device held),
    gRPC calls wait in the front: six cancelled (RST_STREAM), a stream of five cancelled,
    one past its ``grpc-timeout``; none reaches the device, each is counted ``queued``."""
    with held_device(runtime, tmp_path) as held:
        metrics = held.metrics
        before = figures(metrics)
        held.hold.touch()
        holders = [_occupy(held.port) for _ in range(4)]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{held.grpc_port}")
        try:
            # The four with tritonserver before any call comes: a batch of one or two held
            # on the device, the rest queued there.
            wait_until(lambda: figures(metrics)["nv_inference_pending_request_count"] >= 2,
                       "the window full")  # fmt: skip
            x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            x.set_data_from_numpy(np.ones((1, 16), np.float32))
            calls = [client.async_infer("m", [x], lambda result, error: None) for _ in range(6)]
            _until_waiting(metrics, 6, "6 waiting in the front")
            for call in calls:
                call.cancel()
            client.start_stream(lambda result, error: None)
            for _ in range(5):
                client.async_stream_infer("m", [x])
            _until_waiting(metrics, 5, "5 of a stream waiting")
            client.stop_stream(cancel_requests=True)
            with pytest.raises(Exception, match="(?i)deadline"):
                client.infer("m", [x], client_timeout=0.2)
            _until_waiting(metrics, 0, "none waiting")
            held.hold.unlink()
            got = {k: v - before[k] for k, v in settled(metrics, 1 + 4 + 12).items()}
        finally:
            client.close()
            for s in holders:
                s.close()
    assert got["queued"] == 12, got
    assert got["nv_inference_request_success"] == 4, got  # the holders' only


@pytest.mark.parametrize("runtime", ["pytriton", "triton"])
def test_eight_clients_through_a_full_window_get_their_own_answers_and_leave_it_empty(
    runtime, add_sub_path
):
    """Max batch 1: the front forwards two requests at a time, so six of eight clients
    (half on HTTP, half on gRPC) wait in the window at any moment; every answer is that
    client's own sum, nothing is counted abandoned, and once they stop nothing waits."""
    model = ModelConfig(str(add_sub_path), "m", batching=BatchingPolicy(max_batch_size=1))
    with on(runtime)(model) as served:
        metrics = served.triton_metrics
        assert metrics is not None

        def work(k: int) -> None:
            grpc = k % 2
            lib = grpcclient if grpc else httpclient
            port = served.grpc_port if grpc else served.http_port
            client = lib.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                for i in range(10):
                    a = np.full((1, 16), 100 * k + i, np.float32)
                    b = np.arange(16, dtype=np.float32)[None]
                    tensors = []
                    for name, value in (("INPUT0", a), ("INPUT1", b)):
                        t = lib.InferInput(name, [1, 16], "FP32")
                        t.set_data_from_numpy(value)
                        tensors.append(t)
                    out = client.infer("m", tensors).as_numpy("OUTPUT0")
                    np.testing.assert_array_equal(out, a + b)
            finally:
                client.close()

        each_client(work)
        got = figures(metrics)
        assert _waiting(metrics) == 0
        assert got["nv_inference_request_success"] >= 80, got
        assert got["nv_inference_pending_request_count"] == 0, got
        assert got["queued"] == got["forwarded"] == 0, got


@pytest.mark.parametrize("direct", [False, True], ids=["ray-proxy", "ray-direct"])
def test_on_ray_clients_that_leave_never_reach_the_device(direct, tmp_path):
    """The device held by four requests (max batch 2), 20 clients send one each and leave:
    Ray Serve's proxy cancels a request whose client left (one not yet handed to servekit's
    ingress is dropped by Ray's router, uncounted); with ``[ray] direct`` the ingress's own
    HTTP server does. One queued in the ingress's batcher is dropped there (``queued``);
    one already in a batch on its way runs, its answer dropped (``running``), and never
    takes the batch of a client who stayed with it: each holder reads its answer."""
    with held_device("ray", tmp_path, direct=direct) as held:
        url = held.metrics
        before = figures(url)
        held.hold.touch()
        with contextlib.ExitStack() as stack:
            holders = [
                stack.enter_context(contextlib.closing(_occupy(held.port))) for _ in range(4)
            ]
            wait_until(held.entered, "the device held", 60)
            leave(held.port, 20, np.zeros((1, 16), np.float32))
            held.hold.unlink()
            for s in holders:
                assert answered(s).startswith(b"HTTP/1.1 200"), "a holder's answer"
        wait_until(lambda: figures(url)["nv_inference_pending_request_count"] == 0,
                   "nothing pending", 60)  # fmt: skip
        got = {k: v - before[k] for k, v in figures(url).items()}
    left = got["nv_inference_count"] - 4
    assert 0 <= left <= 2 * 2, got  # leavers' rows: at most the two batches handed on
    assert got["running"] <= left, got
    assert got["queued"] + got["running"] <= 20, got
    if direct:  # every client that left is counted once, by servekit's own server
        assert got["queued"] + left == 20, got


@pytest.mark.parametrize("runtime", ["pytriton", "triton", "ray"])
def test_the_kserve_timeout_parameter_drops_requests_queued_past_it(runtime, tmp_path):
    """Behind a held batch (max batch 2, four holders), six requests whose ``timeout``
    (100 ms; the queue policy allows the override) passes while they wait are answered
    with an error that says so and never run: the fronts fail them in their window
    (tritonserver 2.51 ran all six on its own port), servekit's ingress batcher on Ray.
    Only one that overtook a holder into the batch handed on (the window's two
    batches; on Ray, the batch sent ahead to the replica) runs, and is answered."""
    policy = BatchingPolicy(
        max_batch_size=2, default_queue_policy=QueuePolicy(allow_timeout_override=True)
    )
    x = np.ones((1, 16), np.float32)
    with held_device(runtime, tmp_path, policy) as held:
        before = figures(held.metrics)
        held.hold.touch()
        with contextlib.ExitStack() as stack:
            holders = [
                stack.enter_context(contextlib.closing(_occupy(held.port))) for _ in range(4)
            ]
            wait_until(held.entered, "the device held", 60)
            late = []
            for _ in range(6):
                s = stack.enter_context(
                    contextlib.closing(socket.create_connection(("127.0.0.1", held.port)))
                )
                s.sendall(http_request(x, {"timeout": 100_000}))
                late.append(s)
            time.sleep(0.5)  # past their timeout
            held.hold.unlink()
            for s in holders:
                assert answered(s).startswith(b"HTTP/1.1 200"), "a holder's answer"
            answers = [answered(s) for s in late]
        got = {k: v - before[k] for k, v in figures(held.metrics).items()}
        timed_out = _timed_out(held.metrics) if runtime != "ray" else None
    ran = [a for a in answers if a.startswith(b"HTTP/1.1 200")]
    for answer in answers:
        assert answer in ran or b"time" in answer.lower().partition(b"\r\n\r\n")[2], answer
    assert len(ran) <= 2, answers  # at most the one batch handed on
    assert got["nv_inference_count"] == 4 + len(ran), got
    assert timed_out in (None, 6 - len(ran)), timed_out  # counted by the fronts' window
