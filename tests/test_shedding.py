"""Shed what cannot make its deadline (issue 71, part 2): with ``shed_late`` a request
whose deadline falls before the queue's expected answer (its own measured batch times) is
refused at once, 503 with ``Retry-After`` / UNAVAILABLE, and counted in
``servekit_requests_shed_total``; without a deadline, or with the knob off, nothing is.

The Batcher runs in-process on a batch function of known duration; the served tests use
real clients (raw HTTP, tritonclient's gRPC) against native's servers on a simulated device.
"""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import onnx
import pytest

from conftest import needs_runtime, on, sample, scrape, wait_until
from servekit import Batcher, BatchingPolicy, ModelConfig, ModelSpec, Shed, TensorSpec
from servekit.bench.payload import raw_http_infer
from servekit.zoo.tiny import build_simulated

grpcclient = pytest.importorskip("tritonclient.grpc")

SPEC = ModelSpec((TensorSpec("x", np.float32, [1]),), (TensorSpec("y", np.float32, [1]),), 64)
BATCH_S = 0.04
"""What one batch takes (the batch function sleeps so long)."""


async def _burst(shed_late: bool, timeout_us: int | None, n: int = 24) -> tuple[list, Batcher]:
    async def fn(inputs):
        await asyncio.sleep(BATCH_S)
        return {"y": inputs["x"] * 2}

    policy = BatchingPolicy(max_batch_size=4, shed_late=shed_late)
    batcher = Batcher(fn, policy, spec=SPEC, name="b")
    x = np.ones((1, 1), np.float32)
    await batcher.infer({"x": x})  # one batch measured: the pace to judge by
    calls = [batcher.infer({"x": x * i}, timeout_us=timeout_us) for i in range(n)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    await batcher.aclose()
    return results, batcher


def test_requests_the_queue_would_answer_after_their_deadline_are_refused_at_once():
    # 90 ms: the first runs at once (one batch time, 40 ms), four queue behind it (half
    # the running batch and one more: 60 ms); the next four would need 100 ms.
    results, batcher = asyncio.run(_burst(True, 90_000))
    shed = [r for r in results if isinstance(r, Shed)]
    answered = [r for r in results if isinstance(r, dict)]
    assert len(shed) + len(answered) == len(results), results
    assert 1 <= len(answered) <= 5 and len(shed) >= 19, (len(answered), len(shed))
    assert "deadline" in str(shed[0]) and "shed_late" in str(shed[0])
    assert shed[0].retry_after_s >= 1
    assert batcher.stats.request_shed == len(shed)
    assert batcher.stats.inference_count == 1 + len(answered)  # the shed never ran


@pytest.mark.parametrize(("shed_late", "timeout_us"), [(False, 90_000), (True, None)])
def test_without_the_knob_or_without_a_deadline_nothing_is_shed(shed_late, timeout_us):
    results, batcher = asyncio.run(_burst(shed_late, timeout_us))
    assert all(isinstance(r, dict) for r in results), results
    assert batcher.stats.request_shed == 0


def test_one_slow_batch_never_locks_shedding_on():
    """The first batch takes 0.5 s, the rest 10 ms: a request with 0.1 s left that finds
    the batcher idle runs (and measures afresh) instead of being shed for ever."""
    durations = iter([0.5])

    async def fn(inputs):
        await asyncio.sleep(next(durations, 0.01))
        return {"y": inputs["x"]}

    async def main() -> Batcher:
        batcher = Batcher(fn, BatchingPolicy(max_batch_size=4, shed_late=True), spec=SPEC)
        x = np.ones((1, 1), np.float32)
        for _ in range(5):
            await batcher.infer({"x": x}, timeout_us=100_000)
        await batcher.aclose()
        return batcher

    batcher = asyncio.run(main())
    assert batcher.stats.request_shed == 0 and batcher.stats.request_success == 5


def test_a_queue_timeout_bounds_when_a_request_starts_not_when_it_is_answered():
    """REJECT at 50 ms in the queue, batches of 40 ms: behind one running batch a request
    starts in time (answered after its timeout: served); DELAY's timeout is no deadline."""
    from servekit import QueuePolicy, TimeoutAction

    for action in (TimeoutAction.REJECT, TimeoutAction.DELAY):
        queue = QueuePolicy(default_timeout_us=50_000, timeout_action=action)
        policy = BatchingPolicy(max_batch_size=4, shed_late=True, default_queue_policy=queue)

        async def fn(inputs):
            await asyncio.sleep(BATCH_S)
            return {"y": inputs["x"]}

        async def main(policy=policy) -> list:
            batcher = Batcher(fn, policy, spec=SPEC)
            x = np.ones((1, 1), np.float32)
            await batcher.infer({"x": x})
            return await asyncio.gather(
                *(batcher.infer({"x": x}) for _ in range(2)), return_exceptions=True
            )

        results = asyncio.run(main())
        assert all(isinstance(r, dict) for r in results), (action, results)


def test_the_policy_knob_round_trips_through_a_config_table():
    policy = BatchingPolicy(max_batch_size=8, shed_late=True)
    assert BatchingPolicy.from_dict(policy.to_dict()) == policy
    with pytest.raises(ValueError, match="shed_lat"):
        BatchingPolicy.from_dict({"shed_lat": True})


# ------------------------------------------------------------------- every runtime, served

SLOW_S = 1.0
RUNTIMES = ["native", "pytriton", "triton"]


@pytest.fixture(scope="module")
def slow_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("shed") / "slow.onnx"
    onnx.save(build_simulated("shed-slow", SLOW_S * 1e6, 0), path)
    return path


def _request(timeout_us: int | None = None) -> bytes:
    parameters = {"timeout": timeout_us} if timeout_us else {}
    return raw_http_infer("m", {"INPUT0": np.ones((1, 16), np.float32)}, parameters)


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _length(answer):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _length(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return len(answer) + 1


def _shed_count(metrics: str) -> float:
    return sample(scrape(metrics), "servekit_requests_shed", model="m", version="1")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_deadline_the_queue_cannot_make_is_refused_at_once_on_every_runtime(runtime, slow_path):
    """One batch takes 1 s: once the pace is measured and while a batch runs, a request
    with 0.1 s left is refused unrun, 503 with Retry-After over HTTP (its ``timeout``
    parameter) and UNAVAILABLE over gRPC (its deadline); one with 5 s is served. An idle
    server sheds nothing: the request runs and measures the pace afresh."""
    policy = BatchingPolicy(max_batch_size=32, shed_late=True)
    with on(runtime)(ModelConfig(str(slow_path), "m", batching=policy)) as served:
        metrics = served.triton_metrics or f"http://127.0.0.1:{served.http_port}/metrics"
        assert _exchange(served.http_port, _request()).startswith(b"HTTP/1.1 200")  # the pace
        holder = socket.create_connection(("127.0.0.1", served.http_port))
        holder.sendall(_request())  # a batch running for the next second
        time.sleep(0.1)
        started = time.monotonic()
        answer = _exchange(served.http_port, _request(timeout_us=100_000))
        assert time.monotonic() - started < SLOW_S, "shed only after waiting"
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503"), answer[:300]
        assert b"\r\nretry-after: " in head, head
        assert b"deadline" in answer and b"shed_late" in answer, answer
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
        try:
            x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            x.set_data_from_numpy(np.ones((1, 16), np.float32))
            with pytest.raises(Exception, match="shed_late") as refused:
                client.infer("m", [x], client_timeout=0.1)  # its gRPC deadline, 100 ms
            assert "UNAVAILABLE" in str(refused.value), refused.value
        finally:
            client.close()
        ok = _exchange(served.http_port, _request(timeout_us=5_000_000))
        assert ok.startswith(b"HTTP/1.1 200"), ok[:300]
        holder.close()
        wait_until(lambda: _shed_count(metrics) == 2, "two requests counted shed", 10)


def test_on_ray_the_ingress_sheds_over_http_with_retry_after(slow_path):
    """Ray: the ingress's batcher judges (Ray Serve's proxy serves HTTP only)."""
    needs_runtime("ray")
    from ray import serve as ray_serve

    from conftest import ray_serve as serve_start
    from servekit import RayOptions, ServeConfig, ServerConfig
    from servekit.ray import build_app

    policy = BatchingPolicy(max_batch_size=32, shed_late=True)
    model = ModelConfig(str(slow_path), "m", batching=policy)
    config = ServeConfig((model,), ServerConfig(), runtime="ray", ray=RayOptions(model_cpus=0.5))
    with serve_start() as url:
        ray_serve.run(build_app(config), name="servekit", route_prefix="/")
        try:
            port = int(url.rsplit(":", 1)[1])
            wait_until(lambda: _exchange(port, _request()).startswith(b"HTTP/1.1 200"),
                       "the pace measured", 60)  # fmt: skip
            holder = socket.create_connection(("127.0.0.1", port))
            holder.sendall(_request())  # a batch running for the next second
            time.sleep(0.2)
            answer = _exchange(port, _request(timeout_us=100_000))
            head = answer.partition(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"http/1.1 503"), answer[:300]
            assert b"\r\nretry-after: " in head and b"shed_late" in answer, answer
            ok = _exchange(port, _request(timeout_us=5_000_000))
            assert ok.startswith(b"HTTP/1.1 200"), ok[:300]
            holder.close()
        finally:
            ray_serve.delete("servekit")
