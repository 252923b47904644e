"""`servekit serve --front`: servekit's KServe v2 front on PyTriton's public HTTP port.

The requests that abort or 500 tritonserver 2.51 straight on its own HTTP port get a 400
naming the problem from the front, the server stays up, and valid requests, image
requests, gRPC, and Triton's request parameters still work through it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.request

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra: pip install 'servekit[triton]'")

from conftest import each_client, scrape, served_models
from servekit import BatchingPolicy, InvalidInput, OnnxRuntimeRunner
from servekit.client import AsyncClient, Client
from servekit.config import ServerConfig
from servekit.front.forwarded import ForwardedModel
from servekit.pytriton import TritonServer
from servekit.stages import synthetic_image


@pytest.fixture(scope="module")
def server(tiny_cnn_path):
    config = ServerConfig.on_loopback(
        exit_timeout_s=2,
        front=True,
        max_body_bytes=2_000_000,
    )
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_us=2000)
    srv = TritonServer(served_models(tiny_cnn_path, name="tiny", policy=policy), config)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def post(port: int, body: dict | str, path: str = "/v2/models/tiny/infer") -> tuple[int, dict]:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=raw)
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else {}
    finally:
        conn.close()


def one(shape, data) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": shape, "data": data}]}


def test_the_public_http_port_is_servekits_front(server):
    with urllib.request.urlopen(f"{server.server.http_url}/v2", timeout=10) as r:
        assert json.loads(r.read())["name"] == "servekit"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # Straight on tritonserver 2.51's HTTP port: SIGABRT, every in-flight request lost.
        (one([100000000, 3, 32, 32], [0.0]), "claims 307200000000 elements"),
        # Straight on it: HTTP 500 each.
        (one([1, 3, 32, 32], [0.0] * 10), "claims 3072 elements"),
        (one([1, -3, 32, 32], [0.0]), "non-negative"),
        (one([1, 3], ["a", "b", "c"]), "is not FP32"),
        # Checked against the model's spec before anything reaches Triton.
        (one([1, 3, 16, 16], [0.0] * 768), "input"),
        ("{not json", "not valid JSON"),
    ],
)
def test_requests_that_break_tritonserver_get_a_400_from_the_front(server, body, message):
    status, payload = post(server.server.http_port, body)
    assert status == 400, payload
    assert message in payload["error"]
    assert server.is_alive()


def test_an_oversized_body_gets_413(server):
    status, payload = post(server.server.http_port, "x" * 2_000_001)
    assert status == 413 and "exceeds the limit" in payload["error"]


def test_valid_requests_answer_as_in_process_over_http_and_grpc(server, tiny_cnn_path):
    x = np.random.default_rng(3).standard_normal((5, 3, 32, 32)).astype(np.float32)
    want = OnnxRuntimeRunner(tiny_cnn_path).infer({"input": x})["logits"]
    for url in (server.server.http_url, server.server.grpc_url):
        with Client(url) as c:
            np.testing.assert_allclose(
                c.infer("tiny", {"input": x})["logits"], want, rtol=1e-5, atol=1e-5
            )
            assert len(c.classify([synthetic_image(1)], "tiny_image")[0]) == 5
    status, payload = post(server.server.http_port, one([1, 3, 32, 32], x[0].ravel().tolist()))
    assert status == 200
    np.testing.assert_allclose(payload["outputs"][0]["data"], want[0], rtol=1e-5, atol=1e-5)


def test_a_forwarded_model_infers_with_tensors_over_tritons_grpc(server, tiny_cnn_path):
    # ForwardedModel.infer: tensors from Python code (the HTTP fast path passes bytes on).
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    x = np.random.default_rng(4).standard_normal((3, 3, 32, 32)).astype(np.float32)
    model = ForwardedModel("tiny", runner.spec, server.server.grpc_url)

    async def infer_then_bad_dtype() -> dict[str, np.ndarray]:
        try:
            out = await model.infer({"input": x})
            with pytest.raises(InvalidInput, match="input"):
                await model.infer({"input": x.astype(np.float64)})
            return out
        finally:
            await model.aclose()

    out = asyncio.run(infer_then_bad_dtype())
    want = runner.infer({"input": x})["logits"]
    np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-5)


def test_a_wrong_dtype_names_the_tensor_through_the_client(server):
    with Client(server.server.http_url) as c, pytest.raises(InvalidInput, match="input"):
        c.infer("tiny", {"input": np.zeros((1, 3, 32, 32), np.float64)})


def test_request_parameters_reach_triton_through_the_front(server):
    body = one([1, 3, 32, 32], [0.5] * 3072) | {
        "parameters": {"priority": 0, "timeout": 10_000_000}
    }
    status, payload = post(server.server.http_port, body)
    assert status == 200, payload
    status, payload = post(
        server.server.http_port, one([1, 3, 32, 32], [0.5] * 3072) | {"parameters": {"timeout": -1}}
    )
    assert status == 400 and "'timeout'" in payload["error"]


async def _concurrent(url: str, n: int) -> list[np.ndarray]:
    import asyncio

    client = AsyncClient(url)
    try:
        xs = [np.full((1, 3, 32, 32), i / n, np.float32) for i in range(n)]
        return await asyncio.gather(*(client.infer("tiny", {"input": x}) for x in xs))
    finally:
        await client.close()


def test_concurrent_requests_each_get_their_own_answer(server, tiny_cnn_path):
    import asyncio

    n = 24
    got = asyncio.run(_concurrent(server.server.http_url, n))
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    for i, out in enumerate(got):
        want = runner.infer({"input": np.full((1, 3, 32, 32), i / n, np.float32)})["logits"]
        np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-5)


def test_eight_clients_two_sending_values_of_the_wrong_kind(server, tiny_cnn_path):
    """The front's refusals of values tritonserver itself answers with a 500 (true in FP32
    data, a number no double holds, a binary flag that is no boolean) come alone: the
    other requests, batched together on tritonserver, get their own answers, and the
    model is idle after."""
    port = server.server.http_port
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    wants = {
        k: runner.infer({"input": np.full((1, 3, 32, 32), k / 8, np.float32)})["logits"]
        for k in range(8)
    }
    too_big = '{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], '
    too_big += '"data": [1e400' + ", 0" * 3071 + "]}]}"
    bad = [
        (one([1, 3, 32, 32], [True] * 3072), "is not FP32"),
        (too_big, "1e400"),
        ({**one([1, 3, 32, 32], [0.0] * 3072), "parameters": {"binary_data_output": "yes"}},
         "binary_data_output"),
    ]  # fmt: skip

    def client(k: int) -> None:
        for i in range(6):
            if k < 2 and i % 2:
                body, says = bad[(k + i) % 3]
                status, payload = post(port, body)
                assert status == 400 and says in payload["error"], (status, payload)
                continue
            status, payload = post(port, one([1, 3, 32, 32], [k / 8] * 3072))
            assert status == 200, payload
            (logits,) = [o for o in payload["outputs"] if o["name"] == "logits"]
            got = np.asarray(logits["data"], np.float32).reshape(wants[k].shape)
            np.testing.assert_allclose(got, wants[k], rtol=1e-5, atol=1e-5)

    each_client(client)
    assert server.is_alive()
    idle = ("nv_inference_pending_request_count", frozenset({("model", "tiny"), ("version", "1")}))
    assert scrape(server.server.metrics_url)[idle] == 0


def post_binary(port: int, model: str, header: dict, tail: bytes) -> tuple[int, dict]:
    """A request with its tensors in binary after the JSON header; the answer's JSON."""
    head = json.dumps(header).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            f"/v2/models/{model}/infer",
            body=head + tail,
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else {}
    finally:
        conn.close()


def test_a_binary_header_seen_before_is_still_checked_against_its_body(server, tiny_cnn_path):
    # The front remembers a binary request's header that passed, keyed by the body's length.
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    header = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32],
             "parameters": {"binary_data_size": 3072 * 4}}
        ]
    }  # fmt: skip
    port = server.server.http_port
    for seed in (1, 2):  # the second request's header is remembered: its own tensor is answered
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        status, payload = post_binary(port, "tiny", header, x.tobytes())
        assert status == 200, payload
        want = runner.infer({"input": x})["logits"]
        np.testing.assert_allclose(payload["outputs"][0]["data"], want[0], rtol=1e-5, atol=1e-5)
    x = np.zeros((1, 3, 32, 32), np.float32).tobytes()
    status, payload = post_binary(port, "tiny", header, x[:-4])
    assert status == 400 and "binary_data_size 12288 exceeds the 12284" in payload["error"]
    status, payload = post_binary(port, "tiny", header, x + b"\0\0\0\0")
    assert status == 400 and "4 binary bytes after the last input" in payload["error"]


def test_bytes_tensors_are_checked_on_every_request(server):
    # A BYTES tensor's framing is in its bytes, so its header alone never clears it.
    jpeg = synthetic_image(1)
    header = {
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [1, 1],
             "parameters": {"binary_data_size": 4 + len(jpeg)}}
        ]
    }  # fmt: skip
    good = len(jpeg).to_bytes(4, "little") + jpeg
    for _ in range(2):
        status, payload = post_binary(server.server.http_port, "tiny_image", header, good)
        assert status == 200, payload
    bad = (len(jpeg) + 1).to_bytes(4, "little") + jpeg  # same header, same length
    status, payload = post_binary(server.server.http_port, "tiny_image", header, bad)
    assert status == 400, payload
    assert f"input 'image': BYTES element 0 claims {len(jpeg) + 1} bytes" in payload["error"]
