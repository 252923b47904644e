"""An INT8 (QDQ) model from servekit optimize, served by PyTriton and by the servekit Triton
backend, answers exactly as it does in-process."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra")

from conftest import served_models
from servekit import BatchingPolicy, OnnxRuntimeRunner, image_classifier
from servekit.client import Client
from servekit.config import ServerConfig
from servekit.optimize import optimize
from servekit.pytriton import TritonServer
from servekit.stages import synthetic_image
from servekit.triton.launcher import TritonOptions, TritonProcess
from servekit.triton.repo import build_repository, runner_model

POLICY = BatchingPolicy(max_batch_size=8)


@pytest.fixture(scope="module")
def int8_model(tiny_cnn_path, tmp_path_factory):
    return optimize(
        tiny_cnn_path, "int8", output=tmp_path_factory.mktemp("int8") / "tiny.int8.onnx"
    )


def inputs() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((4, 3, 32, 32)).astype(np.float32)


def test_pytriton_serves_the_int8_model_like_in_process(int8_model):
    config = ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    local = OnnxRuntimeRunner(int8_model)
    images = [synthetic_image(i) for i in range(3)]
    models = served_models(int8_model, name="tiny", policy=POLICY)
    with TritonServer(models, config), Client(config.grpc_url) as c:
        got = c.infer("tiny", {"input": inputs()})["logits"]
        classified = c.classify(images, model="tiny_image")
    np.testing.assert_allclose(
        got, local.infer({"input": inputs()})["logits"], rtol=1e-5, atol=1e-5
    )
    assert classified == image_classifier(local).classify(images)


def test_the_triton_backend_serves_the_int8_model_like_in_process(int8_model, tmp_path):
    local = OnnxRuntimeRunner(int8_model)
    build_repository(tmp_path / "repo", [runner_model("tiny_int8", int8_model, POLICY)])
    options = TritonOptions(
        tmp_path / "repo", ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    )
    with TritonProcess(options) as triton:
        triton.wait_ready(["tiny_int8"])
        with Client(options.server.http_url) as c:
            got = c.infer("tiny_int8", {"input": inputs()})["logits"]
    np.testing.assert_allclose(
        got, local.infer({"input": inputs()})["logits"], rtol=1e-5, atol=1e-5
    )
