"""The KServe v2 HTTP front: the codec against tritonclient's own encoder and decoder, and a
real uvicorn server on loopback reached with tritonclient's HTTP client."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

th = pytest.importorskip("tritonclient.http", reason="needs tritonclient (triton extra)")
uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn (http extra)")

from conftest import serving, wait_until
from servekit import (
    Batcher,
    BatchingPolicy,
    FunctionRunner,
    InvalidInput,
    ModelSpec,
    OnnxRuntimeRunner,
    QueuePolicy,
    TensorSpec,
    image_classifier,
)
from servekit.client import Client
from servekit.http import KServeApp
from servekit.protocol.kserve import decode_request, encode_response
from servekit.stages import synthetic_image


def with_binary(header: bytes, tail: bytes) -> tuple[bytes, int]:
    return header + tail, len(header)


HDR8 = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]}'
HDR4 = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 4}}]}'


def encoded(inputs, binary=True):
    ins = []
    for name, a in inputs.items():
        i = th.InferInput(
            name,
            list(a.shape),
            "BYTES" if a.dtype == object else {np.float32: "FP32", np.int64: "INT64"}[a.dtype.type],
        )
        i.set_data_from_numpy(a, binary_data=binary)
        ins.append(i)
    return th.InferenceServerClient.generate_request_body(ins)


@pytest.mark.parametrize("binary", [True, False])
def test_requests_from_tritonclient_decode_to_the_same_arrays(binary):
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    s = np.array([[b"ab"], [b"\x00\xffc"]], dtype=object)
    inputs = {"x": x} if not binary else {"x": x, "s": s}
    body, length = encoded(inputs, binary)
    request = decode_request(body, length)
    np.testing.assert_array_equal(request.inputs["x"], x)
    if binary:
        assert request.inputs["s"].tolist() == s.tolist()


def test_responses_parse_with_tritonclient_both_ways():
    out = {
        "y": np.arange(6, dtype=np.float32).reshape(2, 3),
        "labels": np.array([[b"cat"], [b"dog"]], dtype=object),
    }
    plain = decode_request(
        json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}
        ).encode()
    )
    body, headers = encode_response("m", out, plain)
    parsed = th.InferenceServerClient.parse_response_body(body)
    np.testing.assert_array_equal(parsed.as_numpy("y"), out["y"])
    binary_request = decode_request(
        json.dumps(
            {
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
                "parameters": {"binary_data_output": True},
            }
        ).encode()
    )
    body, headers = encode_response("m", out, binary_request)
    parsed = th.InferenceServerClient.parse_response_body(
        body, header_length=int(headers["inference-header-content-length"])
    )
    np.testing.assert_array_equal(parsed.as_numpy("y"), out["y"])
    assert parsed.as_numpy("labels").tolist() == out["labels"].tolist()


@pytest.mark.parametrize(
    ("body", "length", "message"),
    [
        (b"{not json", None, "not valid JSON"),
        (b'{"inputs": 3}', None, "an 'inputs' list"),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP33", "shape": [1], "data": [1]}]}',
            None,
            "unknown datatype 'FP33'",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]}]}',
            None,
            r"shape \[2, 2\] needs 4 values, 'data' has 3",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": []}]}',
            None,
            "non-negative integers",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": ["a"]}]}',
            None,
            "'data' is not INT64",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}',
            None,
            "neither 'data' nor binary_data_size",
        ),
        (*with_binary(HDR8, b"XXXX"), "exceeds the 4 binary bytes"),
        (*with_binary(HDR4, b"XXXX"), "needs 8 bytes, got 4"),
        (b"{}", 99, "does not fit"),
    ],
)
def test_malformed_requests_are_invalid_input_naming_the_problem(body, length, message):
    with pytest.raises(InvalidInput, match=message):
        decode_request(body, length)


ADD = ModelSpec((TensorSpec("a", np.float32, [3]),), (TensorSpec("b", np.float32, [3]),), 8)


@pytest.fixture(scope="module")
def front(tiny_cnn_path):
    clf = image_classifier(OnnxRuntimeRunner(tiny_cnn_path), top_k=3)
    gate = threading.Event()
    gate.set()

    def slow_double(d):
        gate.wait(10)
        return {"b": d["a"] * 2}

    batcher = Batcher(clf, BatchingPolicy(max_batch_size=8, max_queue_delay_us=1000), name="image")
    tight = Batcher(
        FunctionRunner(slow_double, ADD),
        BatchingPolicy(max_batch_size=1, default_queue_policy=QueuePolicy(max_queue_size=1)),
        name="tight",
    )
    app = KServeApp(
        {
            "double": FunctionRunner(lambda d: {"b": d["a"] * 2}, ADD),
            "image": batcher,
            "tight": tight,
        },
        max_body_bytes=1_000_000,
    )
    with serving(app) as url:
        yield url, clf, gate


def test_tritonclient_talks_to_the_front(front):
    url, clf, _ = front
    with Client(url) as c:
        assert c.is_ready() and c.is_ready("double")
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(c.infer("double", {"a": a})["b"], a * 2)
        np.testing.assert_array_equal(c.infer("double", {"a": a}, binary=False)["b"], a * 2)
        assert c.metadata("image")["inputs"] == [
            {"name": "image", "datatype": "BYTES", "shape": [-1, 1]}
        ]
        images = [synthetic_image(i) for i in range(3)]
        assert c.classify(images, model="image") == clf.classify(images)


def test_concurrent_async_clients_are_batched_in_process(front):
    url, clf, _ = front
    from servekit.client import AsyncClient

    images = [synthetic_image(10 + i) for i in range(6)]

    async def main():
        async with AsyncClient(url) as c:
            return await asyncio.gather(*[c.classify([img], model="image") for img in images])

    got = [r[0] for r in asyncio.run(main())]
    assert got == clf.classify(images)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post(url: str, body: bytes) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_errors_have_statuses_and_name_the_problem(front):
    url, _, _ = front
    good = json.dumps(
        {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    ).encode()
    status, body, _ = post(f"{url}/v2/models/nope/infer", good)
    assert status == 404 and "unknown model 'nope'" in body["error"]
    status, body, _ = post(f"{url}/v2/models/double/infer", good.replace(b"FP32", b"FP64"))
    assert status == 400 and "expected dtype FP32, got FP64" in body["error"]
    status, body, _ = post(f"{url}/v2/models/double/infer", b"{")
    assert status == 400 and "not valid JSON" in body["error"]
    # Refused on the declared length, before the body is read.
    import http.client

    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
    conn.putrequest("POST", "/v2/models/double/infer")
    conn.putheader("Content-Length", "2000000")
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "exceeds the limit" in json.loads(response.read())["error"]
    conn.close()
    assert get(f"{url}/v2/models/double/versions/7")[0] == 404
    assert get(f"{url}/v2/nothing")[0] == 404
    status, body, _ = post(f"{url}/v2/models/double/infer", good)
    assert status == 200 and body["outputs"][0]["data"] == [2, 4, 6]


def test_a_full_queue_answers_503_with_retry_after(front):
    url, _, gate = front
    body = json.dumps(
        {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    ).encode()
    gate.clear()
    results: list[tuple[int, dict, dict]] = []
    threads = [
        threading.Thread(target=lambda: results.append(post(f"{url}/v2/models/tight/infer", body)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: any(r[0] == 503 for r in results), "a 503 from the full queue", 10)
    finally:
        gate.set()
    for t in threads:
        t.join()
    statuses = sorted(r[0] for r in results)
    assert 503 in statuses and 200 in statuses
    rejected = next(r for r in results if r[0] == 503)
    assert "queue full" in rejected[1]["error"] and rejected[2].get("retry-after") == "1"


def test_a_remembered_binary_header_is_checked_again_when_the_signature_changes():
    # The front remembers binary headers that passed (KServeApp._pass_through); a model
    # re-configured behind it (a new spec) must not inherit that verdict.
    class Behind:
        spec = ModelSpec(
            (TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [2]),), 8
        )

    app, model = KServeApp({}), Behind()
    header = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}}]}'
    body = header + np.ones(2, np.float32).tobytes()
    for _ in range(2):
        assert app._pass_through("m", model, body, str(len(header)))[:3] == (
            body,
            len(header),
            None,
        )
    model.spec = ModelSpec(
        (TensorSpec("x", np.float32, [3]),), (TensorSpec("y", np.float32, [3]),), 8
    )
    with pytest.raises(InvalidInput, match="'x'"):
        app._pass_through("m", model, body, str(len(header)))
