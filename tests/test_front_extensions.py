"""Triton's extensions on servekit's front, beyond what test_conformance runs on every
runtime: raw binary bodies, the decompressed size limit, deep nesting, classification,
statistics and configuration from a Batcher, and the endpoints the front does not serve."""

from __future__ import annotations

import gzip
import json
import urllib.request

import numpy as np
import pytest

from conftest import serving
from servekit.batching import Batcher, BatchingPolicy
from servekit.errors import InvalidInput
from servekit.http.app import KServeApp
from servekit.protocol.kserve import classify, decode_request
from servekit.runners.onnx import OnnxRuntimeRunner


@pytest.fixture(scope="module")
def front(tiny_cnn_path, add_sub_path):
    cnn = OnnxRuntimeRunner(tiny_cnn_path)
    add_sub = OnnxRuntimeRunner(add_sub_path)
    batcher = Batcher(add_sub, BatchingPolicy(8, (4,), 250), instance_count=2, name="add_sub")
    try:
        with serving(
            KServeApp({"tiny_cnn": cnn, "add_sub": batcher}, max_body_bytes=1 << 20)
        ) as url:
            yield url, cnn
    finally:
        batcher.close()
        add_sub.close()
        cnn.close()


def call(url: str, method: str, path: str, body: bytes | None = None, headers=None):
    request = urllib.request.Request(url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def test_a_raw_binary_body_is_the_models_one_input(front):
    url, cnn = front
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    status, body, _ = call(
        url,
        "POST",
        "/v2/models/tiny_cnn/infer",
        x.tobytes(),
        {"Inference-Header-Content-Length": "0"},
    )
    assert status == 200, body
    (out,) = json.loads(body)["outputs"]
    assert out["shape"] == [2, 10]
    np.testing.assert_allclose(
        np.reshape(out["data"], (2, 10)), cnn.infer({"input": x})["logits"], rtol=1e-5
    )
    status, body, _ = call(
        url,
        "POST",
        "/v2/models/tiny_cnn/infer",
        x.tobytes()[:100],
        {"Inference-Header-Content-Length": "0"},
    )
    assert status == 400 and b"not a whole number of rows" in body


def test_the_size_limit_holds_for_the_decompressed_body(front):
    url, _ = front
    bomb = gzip.compress(b" " * (4 << 20))  # 4 MiB of spaces in a few kilobytes
    assert len(bomb) < 10_000
    status, body, _ = call(
        url, "POST", "/v2/models/add_sub/infer", bomb, {"Content-Encoding": "gzip"}
    )
    assert status == 413 and b"decompressed" in body


def test_data_nested_up_to_100_levels_is_flattened_whatever_the_rank_and_beyond_is_refused():
    shape = [1] * 32
    data: list = [1.5]
    for _ in range(99):
        data = [data]
    header = {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": data}]}
    request = decode_request(json.dumps(header).encode())
    assert request.inputs["x"].shape == tuple(shape) and request.inputs["x"].item() == 1.5
    header["inputs"][0]["shape"] = [1]
    assert decode_request(json.dumps(header).encode()).inputs["x"].tolist() == [1.5]
    header["inputs"][0]["data"] = [data]
    with pytest.raises(InvalidInput, match="input 'x': 'data' is nested more than 100 levels"):
        decode_request(json.dumps(header).encode())
    header["inputs"][0]["data"] = data
    header["inputs"][0]["shape"] = [1] * 33
    with pytest.raises(InvalidInput, match="33 dimensions; at most 32"):
        decode_request(json.dumps(header).encode())


def test_classification_is_value_colon_index_highest_first():
    scores = np.array([[0.1, 0.7, 0.2], [3.0, -1.0, 2.0]], np.float32)
    top = classify(scores, 2, "probs")
    assert top.shape == (2, 2)
    assert [v.decode() for v in top[0]] == ["0.700000:1", "0.200000:2"]
    assert [v.decode() for v in top[1]] == ["3.000000:0", "2.000000:2"]
    assert classify(scores, 9, "probs").shape == (2, 3)  # at most the classes there are


def test_configuration_and_statistics_come_from_the_batcher(front):
    url, _ = front
    status, body, _ = call(url, "GET", "/v2/models/add_sub/config")
    config = json.loads(body)
    assert status == 200 and config["max_batch_size"] == 8
    assert config["dynamic_batching"]["preferred_batch_size"] == [4]
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 250
    assert config["instance_group"][0]["count"] == 2
    status, body, _ = call(url, "GET", "/v2/models/tiny_cnn/config")
    assert status == 200 and "dynamic_batching" not in json.loads(body)  # no Batcher: none
    a = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}
    b = {**a, "name": "INPUT1"}
    for _ in range(2):
        assert (
            call(url, "POST", "/v2/models/add_sub/infer", json.dumps({"inputs": [a, b]}).encode())[
                0
            ]
            == 200
        )
    status, body, _ = call(url, "GET", "/v2/models/stats")
    stats = {s["name"]: s for s in json.loads(body)["model_stats"]}
    assert status == 200 and set(stats) == {"add_sub", "tiny_cnn"}
    assert stats["add_sub"]["inference_count"] >= 2
    assert (
        sum(b["compute_infer"]["count"] for b in stats["add_sub"]["batch_stats"])
        == stats["add_sub"]["execution_count"]
    )


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/repository/models/add_sub/load"),
        ("POST", "/v2/repository/models/add_sub/unload"),
        ("GET", "/v2/logging"),
    ],
)
def test_control_endpoints_say_where_they_are_served(front, method, path):
    url, _ = front
    status, body, _ = call(url, method, path, b"{}" if method == "POST" else None)
    assert status == 403
    assert b"gRPC port of the triton and pytriton runtimes" in body


@pytest.mark.parametrize("path", ["/v2/trace/setting", "/v2/models/add_sub/trace/setting"])
def test_trace_settings_without_tracing_say_how_to_turn_it_on(front, path):
    url, _ = front
    status, body, _ = call(url, "GET", path)
    assert status == 403 and b"[server.tracing]" in body


@pytest.mark.parametrize("kind", ["system", "cuda"])
def test_an_app_without_regions_says_where_shared_memory_is_served(front, kind):
    url, _ = front
    body = b'{"key": "/r0", "byte_size": 8}'
    status, answer, _ = call(url, "POST", f"/v2/{kind}sharedmemory/region/r0/register", body)
    assert status == 403
    assert b"native, pytriton and triton runtimes" in answer


def test_a_401_before_the_body_is_read_still_reaches_the_client(add_sub_path):
    """The token check answers before reading a multi-megabyte body: the client gets the
    401, and the keep-alive connection serves the next request."""
    import http.client

    runner = OnnxRuntimeRunner(add_sub_path)
    try:
        with serving(KServeApp({"add_sub": runner}, inference_token="s3cret")) as url:
            host, port = url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                conn.request("POST", "/v2/models/add_sub/infer", body=b" " * 6_000_000)
                answer = conn.getresponse()
                assert answer.status == 401 and b"servekit-inference-token" in answer.read()
                conn.request("GET", "/v2/health/live")
                assert conn.getresponse().status == 200
            finally:
                conn.close()
    finally:
        runner.close()
