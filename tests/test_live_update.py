"""Live model updates: a new version swapped in under load loses no request, mixes no
versions, can be rolled back, and a version that fails to load never replaces the one
serving. First on ``VersionedRunner`` alone, then through a real PyTriton server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import Load
from servekit import BatchingPolicy, FunctionRunner, ModelSpec, OnnxRuntimeRunner, TensorSpec
from servekit.runners.versioned import UpdateRefused, VersionedRunner
from servekit.store import rss_bytes
from servekit.zoo.tiny import build_tiny_cnn

ROWS = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def second_version(tmp_path_factory) -> Path:
    """tiny_cnn with other weights (seed 1): same signature, other answers."""
    path = tmp_path_factory.mktemp("v2") / "tiny_cnn.onnx"
    path.write_bytes(build_tiny_cnn(seed=1).SerializeToString())
    return path


def expected(path: Path) -> np.ndarray:
    with OnnxRuntimeRunner(path) as r:
        return r.infer({"input": ROWS})["logits"]


class Tracked(FunctionRunner):
    """A FunctionRunner that records when it is closed."""

    closed = False

    def close(self) -> None:
        self.closed = True


def constant(value: float, spec: ModelSpec, delay_s: float = 0.0) -> Tracked:
    def fn(inputs):
        time.sleep(delay_s)
        return {"y": np.full((len(inputs["x"]), 1), value, np.float32)}

    return Tracked(fn, spec)


SPEC = ModelSpec([TensorSpec("x", "FP32", [1])], [TensorSpec("y", "FP32", [1])], max_batch_size=4)
X = {"x": np.zeros((2, 1), np.float32)}


def calls(fn: Callable[[], object]) -> Callable[[int], contextlib.AbstractContextManager]:
    return lambda k: contextlib.nullcontext(fn)


def test_each_batch_runs_on_one_version_and_new_batches_on_the_new_one():
    v1, v2 = constant(1.0, SPEC, 0.002), constant(2.0, SPEC, 0.002)
    runner = VersionedRunner(v1, name="m")
    with Load(calls(lambda: runner.infer(X)["y"])) as load:
        load.wait_answers(20)
        assert runner.update(v2) == 2
        after = runner.infer(X)["y"]
        load.wait_answers(20)
    assert not load.failures()
    # A batch is all ones or all twos, never a mix; once update returned, only twos.
    assert {tuple(np.unique(r)) for r in load.results} <= {(1.0,), (2.0,)}
    assert (after == 2.0).all()
    assert runner.version == 2 and not v1.closed  # kept warm for a rollback


def test_rollback_serves_the_previous_version_and_older_ones_are_closed_once_idle():
    v1, v2, v3 = (constant(float(i), SPEC) for i in (1, 2, 3))
    runner = VersionedRunner(v1, name="m")
    runner.update(v2)
    assert runner.rollback() == 1
    assert (runner.infer(X)["y"] == 1.0).all()
    assert runner.rollback() == 2  # and forward again
    runner.update(v3)
    assert v1.closed and not v2.closed and not v3.closed
    runner.close()
    assert v2.closed and v3.closed


def test_a_version_replaced_mid_batch_is_closed_only_after_that_batch():
    started, gate = threading.Event(), threading.Event()

    def held(inputs):
        started.set()
        gate.wait(10)
        return {"y": np.full((len(inputs["x"]), 1), 1.0, np.float32)}

    slow = Tracked(held, SPEC)
    runner = VersionedRunner(slow, name="m")
    runner.update(constant(2.0, SPEC))
    runner.rollback()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(runner.infer(X)))
    t.start()
    assert started.wait(10)  # the slow version (now current again) is mid-batch
    runner.update(constant(3.0, SPEC))  # slow becomes previous: kept
    runner.update(constant(4.0, SPEC))  # slow is now stale but busy: not closed yet
    assert not slow.closed
    gate.set()
    t.join()
    assert (result["y"] == 1.0).all() and slow.closed


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (
            ModelSpec([TensorSpec("x", "FP16", [1])], [TensorSpec("y", "FP32", [1])], 4),
            "inputs differ: expected ['x FP32 [1]'], got ['x FP16 [1]']",
        ),
        (
            ModelSpec([TensorSpec("x", "FP32", [1])], [TensorSpec("z", "FP32", [1])], 4),
            "outputs differ",
        ),
        (
            ModelSpec([TensorSpec("x", "FP32", [1])], [TensorSpec("y", "FP32", [1])], 2),
            "max_batch_size must be at least 4, got 2",
        ),
    ],
)
def test_an_update_with_another_signature_is_refused_and_the_old_version_serves(new, message):
    v1 = constant(1.0, SPEC)
    runner = VersionedRunner(v1, name="m")
    bad = constant(2.0, new)
    with pytest.raises(UpdateRefused, match="^m: ") as info:
        runner.update(bad)
    assert message in str(info.value)
    assert bad.closed and runner.version == 1 and (runner.infer(X)["y"] == 1.0).all()


def test_an_update_that_fails_to_warm_up_is_closed_and_the_old_version_serves():
    def broken(inputs):
        raise RuntimeError("CUDA out of memory")

    bad = Tracked(broken, SPEC)
    runner = VersionedRunner(constant(1.0, SPEC), name="m")
    with pytest.raises(Exception, match="CUDA out of memory"):
        runner.update(bad)
    assert bad.closed and runner.version == 1 and (runner.infer(X)["y"] == 1.0).all()
    with pytest.raises(UpdateRefused, match="no previous version"):
        runner.rollback()


# --- through PyTriton -------------------------------------------------------------------

pytriton = pytest.importorskip("pytriton", reason="needs the triton extra")

from conftest import served_models  # noqa: E402
from servekit.client import Client  # noqa: E402
from servekit.config import ServerConfig  # noqa: E402
from servekit.pytriton import TritonServer  # noqa: E402
from servekit.runtime import load_model_runner  # noqa: E402


def load_model(path, policy):
    """The model file as a runtime loads it (a new version for ``update``)."""
    from servekit import ModelConfig

    return load_model_runner(ModelConfig(str(path), batching=policy))


@pytest.fixture(scope="module")
def server(tiny_cnn_path):
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_us=1000)
    srv = TritonServer(
        served_models(tiny_cnn_path, name="tiny", policy=policy),
        ServerConfig.on_loopback(exit_timeout_s=2, front=True),
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def rss_mb() -> float:
    return rss_bytes() / 2**20


def test_pytriton_swaps_roll_back_and_refuse_bad_versions_under_load_without_a_failed_request(
    server, tiny_cnn_path, second_version, add_sub_path
):
    one, two = expected(tiny_cnn_path), expected(second_version)
    policy = BatchingPolicy(max_batch_size=8)

    @contextlib.contextmanager
    def session(k: int) -> Iterator[Callable[[], np.ndarray]]:
        # Half the threads through the HTTP front, half over gRPC.
        with Client((server.server.http_url, server.server.grpc_url)[k % 2]) as c:
            yield lambda: c.infer("tiny", {"input": ROWS})["logits"]

    def answers_now() -> np.ndarray:
        with Client(server.server.http_url) as c:
            return c.infer("tiny", {"input": ROWS})["logits"]

    with Load(session) as load:
        load.wait_answers(20)
        assert server.update("tiny", load_model(second_version, policy)) == 2
        np.testing.assert_allclose(answers_now(), two, rtol=1e-5)
        load.wait_answers(20)
        assert server.rollback("tiny") == 1
        np.testing.assert_allclose(answers_now(), one, rtol=1e-5)
        load.wait_answers(20)
        with pytest.raises(UpdateRefused, match="inputs differ"):
            server.update("tiny", load_model(add_sub_path, policy))
        assert server.version("tiny") == 1
        server.update("tiny", load_model(second_version, policy))
        load.wait_answers(20)
    assert not load.failures(), load.failures()[:3]
    # Every answer is wholly one version's; the image model follows the same swaps.
    matched = [
        np.allclose(r, one, rtol=1e-5) or np.allclose(r, two, rtol=1e-5) for r in load.results
    ]
    assert all(matched) and len(load.results) > 50
    with Client(server.server.http_url) as c:
        assert c.classify([_jpeg()], model="tiny_image")[0]


def _jpeg() -> bytes:
    from servekit.stages import synthetic_image

    return synthetic_image(0)


def test_fifty_updates_leave_resident_memory_flat(server, tiny_cnn_path, second_version):
    policy = BatchingPolicy(max_batch_size=8)
    versions = [expected(tiny_cnn_path), expected(second_version)]
    sizes = []
    with Client(server.server.grpc_url) as c:
        for cycle in range(1, 51):
            path = (tiny_cnn_path, second_version)[cycle % 2]
            server.update("tiny", load_model(path, policy))
            out = c.infer("tiny", {"input": ROWS})["logits"]
            np.testing.assert_allclose(out, versions[cycle % 2], rtol=1e-5)
            if cycle in (10, 50):
                sizes.append(rss_mb())
    assert sizes[1] - sizes[0] < 30, sizes
