"""The native runtime: servekit's own KServe v2 server, HTTP and gRPC, checked with
tritonclient over loopback against the in-process answers."""

from __future__ import annotations

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import each_client, scrape  # noqa: E402
from servekit import (  # noqa: E402
    BatchingPolicy,
    Client,
    ModelConfig,
    OnnxRuntimeRunner,
    QueuePolicy,
    ServeConfig,
    ServerConfig,
)
from servekit.native import NativeServer  # noqa: E402
from servekit.stages import synthetic_image  # noqa: E402

POLICY = BatchingPolicy(
    max_batch_size=8, max_queue_delay_us=500, default_queue_policy=QueuePolicy(max_queue_size=64)
)


@pytest.fixture(scope="module")
def native(tiny_cnn_path, add_sub_path):
    config = ServeConfig(
        (
            ModelConfig(str(tiny_cnn_path), "tiny", batching=POLICY, instances=2),
            ModelConfig(str(add_sub_path), "adder", batching=POLICY),
        ),
        ServerConfig(exit_timeout_s=2),
        runtime="native",
    ).on_loopback()
    with NativeServer(config) as server:
        yield server


def grpc_client(server):
    return grpcclient.InferenceServerClient(server.config.server.grpc_url.removeprefix("grpc://"))


def test_tritonclient_grpc_health_metadata_and_config(native):
    c = grpc_client(native)
    try:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("tiny")
        assert not c.is_model_ready("nothing")
        assert c.get_server_metadata().name == "servekit"
        meta = c.get_model_metadata("tiny")
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("input", "FP32", [-1, 3, 32, 32])
        ]
        config = c.get_model_config("tiny").config
        assert BatchingPolicy.from_triton(config) == POLICY
        assert config.instance_group[0].count == 2
    finally:
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_equal_in_process_over_both_protocols(native, tiny_cnn_path, protocol):
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    want = OnnxRuntimeRunner(tiny_cnn_path).infer({"input": x})["logits"]
    url = native.config.server.http_url if protocol == "http" else native.config.server.grpc_url
    with Client(url) as c:
        np.testing.assert_allclose(c.infer("tiny", {"input": x})["logits"], want, rtol=1e-5)
        images = [synthetic_image(i) for i in range(2)]
        assert len(c.classify(images, model="tiny_image")) == 2
        a = np.arange(16, dtype=np.float32)[None]
        out = c.infer("adder", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(out["OUTPUT1"], np.zeros_like(a))


def test_typed_contents_and_requested_outputs_over_grpc(native):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    channel = grpc.insecure_channel(native.config.server.grpc_url.removeprefix("grpc://"))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="adder", id="req-7")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        tensor.contents.fp32_contents.extend([2.0] * 16)
    request.outputs.add(name="OUTPUT0")
    response = stub.ModelInfer(request, timeout=30)
    assert response.id == "req-7" and [o.name for o in response.outputs] == ["OUTPUT0"]
    out = np.frombuffer(response.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(out, np.full(16, 4.0, np.float32))
    channel.close()


@pytest.mark.parametrize(
    ("inputs", "code", "message"),
    [
        # The claim that aborts tritonserver 2.51 over HTTP JSON: refused before allocation.
        ({"shape": [100000000, 3, 32, 32], "raw": b"\0" * 4}, "INVALID_ARGUMENT", "claims"),
        ({"shape": [1, 3, 32, 32], "raw": b"\0" * 4000}, "INVALID_ARGUMENT", "needs 12288 bytes"),
        ({"shape": [1, 3, 16, 16], "raw": b"\0" * 3072}, "INVALID_ARGUMENT", "input"),
        (
            {"shape": [1, 3, 32, 32], "datatype": "FP64", "raw": b"\0" * 24576},
            "INVALID_ARGUMENT",
            "FP64",
        ),
    ],
)
def test_bad_grpc_requests_get_a_code_naming_the_problem_and_the_server_lives(
    native, inputs, code, message
):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    channel = grpc.insecure_channel(native.config.server.grpc_url.removeprefix("grpc://"))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="input", datatype=inputs.get("datatype", "FP32"), shape=inputs["shape"])
    request.raw_input_contents.append(inputs["raw"])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code().name == code and message in info.value.details()
    channel.close()
    c = grpc_client(native)
    try:
        assert c.is_server_live()
        with pytest.raises(InferenceServerException, match="nothing"):
            c.infer("nothing", [grpcclient.InferInput("x", [1], "FP32")])
    finally:
        c.close()


def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 160)).save(out, "PNG")
    return out.getvalue()


def test_eight_clients_and_images_that_would_resize_to_gigabytes(native):
    """A PNG of a few hundred bytes, 100000x1 or 1x100000, would resize (shorter side to
    37 for this model, 256 for ResNet-50) to hundreds of millions of pixels: refused by its
    size before any is made, while seven other clients' images are answered as when sent
    alone."""
    url = native.config.server.http_url.removeprefix("http://")
    images = [synthetic_image(k) for k in range(8)]

    def classes(client, data: bytes) -> np.ndarray:
        tensor = httpclient.InferInput("image", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[data]], dtype=object))
        return client.infer("tiny_image", [tensor]).as_numpy("classes")

    with httpclient.InferenceServerClient(url) as c:
        alone = [classes(c, data) for data in images]

    def client(k: int) -> None:
        with httpclient.InferenceServerClient(url) as c:
            for _ in range(5):
                if k == 0:
                    for width, height in ((100_000, 1), (1, 100_000)):
                        with pytest.raises(InferenceServerException) as e:
                            classes(c, _png(width, height))
                        assert e.value.status() == "400", e.value
                        assert (
                            f"input 'image' row 0: image of {width}x{height} pixels would "
                            "resize to" in e.value.message()
                        ), e.value.message()
                else:
                    np.testing.assert_array_equal(classes(c, images[k]), alone[k])

    each_client(client)
    gauges = scrape(f"{native.config.server.http_url}/metrics")
    idle = (
        "nv_inference_pending_request_count",
        frozenset({("model", "tiny_image"), ("version", "1")}),
    )
    assert gauges[idle] == 0  # idle again once the clients stop


def test_the_inference_token_guards_both_protocols(tiny_cnn_path):
    from servekit import Unauthenticated

    config = ServeConfig(
        (ModelConfig(str(tiny_cnn_path), "tiny", image=False),),
        ServerConfig(inference_token="s3cret", exit_timeout_s=1),
        runtime="native",
    ).on_loopback()
    x = {"input": np.zeros((1, 3, 32, 32), np.float32)}
    with NativeServer(config):
        for url in (config.server.http_url, config.server.grpc_url):
            with Client(url) as c, pytest.raises(Unauthenticated):
                c.infer("tiny", x)
            with Client(url, inference_token="s3cret") as c:
                assert c.infer("tiny", x)["logits"].shape == (1, 10)


def test_reload_swaps_the_model_file_between_batches(tmp_path, tiny_cnn_path):
    from servekit.zoo.tiny import build_tiny_cnn

    path = tmp_path / "tiny.onnx"
    path.write_bytes(build_tiny_cnn(seed=0).SerializeToString())
    config = ServeConfig(
        (ModelConfig(str(path), "tiny"),), ServerConfig(exit_timeout_s=1), runtime="native"
    ).on_loopback()
    x = {"input": np.ones((1, 3, 32, 32), np.float32)}
    with NativeServer(config) as server, Client(config.server.grpc_url) as c:
        before = c.infer("tiny", x)["logits"]
        path.write_bytes(build_tiny_cnn(seed=1).SerializeToString())
        assert server.reload() == [f"tiny: reloaded from {path} (reload 1)"]
        after = c.infer("tiny", x)["logits"]
        assert not np.allclose(before, after)
        np.testing.assert_allclose(after, OnnxRuntimeRunner(path).infer(x)["logits"], rtol=1e-5)
