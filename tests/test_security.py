"""Access tokens: one for inference, a separate one for model control, on tritonserver
(`servekit triton`) and on servekit's own KServe v2 front; health stays open for probes."""

from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra")

from conftest import serving
from servekit import FunctionRunner, ServerConfig, Unauthenticated
from servekit.client import AsyncClient, Client
from servekit.errors import CONTROL_TOKEN_HEADER
from servekit.http import KServeApp
from servekit.triton.launcher import TritonOptions, TritonProcess
from servekit.triton.repo import build_repository, runner_model

X = {"input": np.zeros((1, 3, 32, 32), np.float32)}


def http_status(url: str, method: str = "GET", headers: dict | None = None) -> int:
    request = urllib.request.Request(
        url, method=method, headers=headers or {}, data=b"{}" if method == "POST" else None
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


@pytest.fixture(scope="module", params=[False, True], ids=["tritonserver", "front"])
def triton(request, tmp_path_factory, tiny_cnn_path):
    """`servekit triton` with both tokens: HTTP straight on tritonserver, or behind the front."""
    repo = tmp_path_factory.mktemp("repo")
    build_repository(repo, [runner_model("tiny", tiny_cnn_path)])
    server = ServerConfig.on_loopback(
        exit_timeout_s=2, inference_token="infer-secret", control_token="control-secret",
        front=request.param,
    )  # fmt: skip
    options = TritonOptions(repo, server, model_control_mode="explicit", load_models=("tiny",))
    with TritonProcess(options) as process:
        process.wait_ready(["tiny"])
        yield server


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inference_needs_the_inference_token(triton, protocol):
    url = triton.http_url if protocol == "http" else triton.grpc_url
    with Client(url) as c, pytest.raises(Unauthenticated):
        c.infer("tiny", X)
    with Client(url, inference_token="wrong") as c, pytest.raises(Unauthenticated):
        c.infer("tiny", X)
    with Client(url, inference_token="infer-secret") as c:
        assert c.infer("tiny", X)["logits"].shape == (1, 10)


def test_model_control_needs_the_other_token_and_health_stays_open(triton):
    index = f"{triton.http_url}/v2/repository/index"
    unload = f"{triton.http_url}/v2/repository/models/tiny/unload"
    if triton.front:  # model control passes to tritonserver, which checks the client's token
        assert http_status(unload, "POST", {CONTROL_TOKEN_HEADER: "infer-secret"}) == 403
        assert http_status(unload, "POST") == 403
        assert http_status(index, "POST") == 200  # the read-only index is open, as metadata is
        # Metadata: the front reads the model's config from Triton with the control token.
        assert http_status(f"{triton.http_url}/v2/models/tiny") == 200
    else:
        assert http_status(index, "POST") == 403
        assert http_status(unload, "POST", {CONTROL_TOKEN_HEADER: "infer-secret"}) == 403
        assert http_status(index, "POST", {CONTROL_TOKEN_HEADER: "control-secret"}) == 200
    assert http_status(f"{triton.http_url}/v2/health/ready") == 200
    assert http_status(f"{triton.http_url}/v2/models/tiny/ready") == 200  # still loaded


def test_the_servekit_front_checks_the_inference_token():
    from servekit import ModelSpec, TensorSpec

    spec = ModelSpec(
        (TensorSpec("input", np.float32, [1]),), (TensorSpec("y", np.float32, [1]),), 4
    )
    app = KServeApp(
        {"m": FunctionRunner(lambda d: {"y": d["input"]}, spec)}, inference_token="s3cret"
    )
    x = {"input": np.ones((2, 1), np.float32)}
    with serving(app) as url:
        with Client(url) as c, pytest.raises(Unauthenticated, match="servekit-inference-token"):
            c.infer("m", x)
        with Client(url, inference_token="s3cret") as c:
            np.testing.assert_array_equal(c.infer("m", x)["y"], x["input"])

        async def async_call():
            async with AsyncClient(url, inference_token="s3cret") as c:
                return await c.infer("m", x)

        import asyncio

        np.testing.assert_array_equal(asyncio.run(async_call())["y"], x["input"])
        assert http_status(f"{url}/v2/health/ready") == 200
        assert http_status(f"{url}/v2/models/m") == 200  # metadata stays open
