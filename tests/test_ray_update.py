"""Ray redeploy under load: ``serve.run`` with a new model file rolls the replicas over
without a failed request or a mixed answer, a second redeploy rolls back, and an update
whose model does not load is refused on the driver while the old version keeps serving."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra")
serve = pytest.importorskip("ray.serve")

from conftest import Load, ray_serve
from servekit import OnnxRuntimeRunner
from servekit.client import Client
from servekit.ray import build_app
from servekit.zoo.tiny import build_tiny_cnn

ROWS = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)


def version(tmp: Path, folder: str, data: bytes) -> Path:
    path = tmp / folder / "tiny.onnx"
    path.parent.mkdir()
    path.write_bytes(data)
    return path


def deploy(model: Path) -> None:
    app = build_app(
        {
            "model": str(model),
            "name": "tiny",
            "batching": {"max_batch_size": 8, "max_queue_delay_us": 2000},
            "ray": {"model_cpus": 0.25, "stage_cpus": 0.25},
        }
    )
    serve.run(app, name="servekit", route_prefix="/")


@pytest.fixture(scope="module")
def ray_url(tmp_path_factory) -> Iterator[tuple[str, Path, Path]]:
    tmp = tmp_path_factory.mktemp("ray_versions")
    one = version(tmp, "1", build_tiny_cnn(seed=0).SerializeToString())
    two = version(tmp, "2", build_tiny_cnn(seed=1).SerializeToString())
    with ray_serve() as url:
        deploy(one)
        with Client(url) as c:
            c.wait_ready("tiny", timeout_s=120)
        yield url, one, two


def expected(path: Path) -> np.ndarray:
    with OnnxRuntimeRunner(path) as r:
        return r.infer({"input": ROWS})["logits"]


def test_redeploys_and_a_rollback_under_load_lose_nothing_and_mix_nothing(ray_url, tmp_path):
    url, one, two = ray_url
    v1, v2 = expected(one), expected(two)

    @contextlib.contextmanager
    def session(k: int) -> Iterator[Callable[[], np.ndarray]]:
        with Client(url) as c:
            yield lambda: c.infer("tiny", {"input": ROWS})["logits"]

    def answers_now() -> np.ndarray:
        with Client(url) as c:
            return c.infer("tiny", {"input": ROWS})["logits"]

    broken = version(tmp_path, "3", b"not an onnx file")
    with Load(session, threads=3) as load:
        load.wait_answers(10)
        deploy(two)  # returns once the new version's replicas are running
        np.testing.assert_allclose(answers_now(), v2, rtol=1e-5)
        load.wait_answers(10)
        deploy(one)  # rollback: the old file again
        np.testing.assert_allclose(answers_now(), v1, rtol=1e-5)
        # A version that does not load never reaches the cluster: the driver reads the
        # model first, and the serving version stays.
        with pytest.raises(ValueError, match="tiny.onnx: cannot load: InvalidProtobuf"):
            deploy(broken)
        load.wait_answers(10)
    assert not load.failures(), load.failures()[:3]
    answers = load.results
    matched = [np.allclose(r, v1, rtol=1e-5) or np.allclose(r, v2, rtol=1e-5) for r in answers]
    assert all(matched) and len(answers) > 20
    assert any(np.allclose(r, v2, rtol=1e-5) for r in answers)  # the load did see v2
    np.testing.assert_allclose(answers_now(), v1, rtol=1e-5)
