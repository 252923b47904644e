"""Hostile and malformed requests against servekit's KServe v2 front on a real uvicorn server:
every one gets a 4xx naming the problem, none allocates what it claims, and the server
answers a valid request correctly afterwards."""

from __future__ import annotations

import http.client
import json
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

uvicorn = pytest.importorskip("uvicorn", reason="needs uvicorn (http extra)")

from conftest import serving, wait_until
from servekit import Batcher, BatchingPolicy, FunctionRunner, ModelSpec, TensorSpec
from servekit.http import KServeApp

SPEC = ModelSpec(
    (TensorSpec("x", np.float32, [3]), TensorSpec("s", "BYTES", [1])),
    (TensorSpec("y", np.float32, [3]),),
    8,
)
DOCUMENTED = {200, 400, 404, 405, 413, 503}


def double(d):
    return {"y": d["x"] * 2}


@pytest.fixture(scope="module")
def server():
    batcher = Batcher(FunctionRunner(double, SPEC), BatchingPolicy(max_batch_size=8), name="m")
    app = KServeApp({"m": batcher}, max_body_bytes=1_000_000)
    try:
        with serving(app) as url:
            yield int(url.rsplit(":", 1)[1])
    finally:
        batcher.close()


def post(
    port: int, body: bytes, headers: dict[str, str] | None = None, path: str = "/v2/models/m/infer"
):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def valid(port: int) -> None:
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]},
            {"name": "s", "datatype": "BYTES", "shape": [1, 1], "data": ["a"]},
        ]
    }
    status, payload = post(port, json.dumps(body).encode())
    assert status == 200, payload
    assert json.loads(payload)["outputs"][0]["data"] == [2, 4, 6]


DATA_101_DEEP: list = [1.0]
for _ in range(100):
    DATA_101_DEEP = [DATA_101_DEEP]


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        # The request that aborts tritonserver 2.51 (SIGABRT): a huge shape, one value.
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [100000000, 3, 224, 224],
                        "data": [0.0],
                    }
                ]
            },
            {},
            "claims 15052800000000 elements",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2]}]},
            {},
            "needs 6 values",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, -3], "data": [1]}]},
            {},
            "non-negative",
        ),
        (
            {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": ["a", "b", "c"]}
                ]
            },
            {},
            "is not FP32",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]},
            {},
            "unknown datatype",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": DATA_101_DEEP}]},
            {},
            "nested more than 100 levels deep",
        ),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "parameters": []}]},
            {},
            "'parameters' must be an object",
        ),
        ({"inputs": [], "outputs": [{"name": ["y"]}]}, {}, "'outputs' must be a list"),
        ({"inputs": "x"}, {}, "'inputs' list"),
        ("[" * 200_000, {}, "nested too deeply"),
        ("{not json", {}, "not valid JSON"),
        ({"inputs": []}, {"Inference-Header-Content-Length": "12abc"}, "expected a byte count"),
        ({"inputs": []}, {"Inference-Header-Content-Length": "999999"}, "does not fit"),
    ],
)
def test_each_hostile_request_gets_a_400_naming_the_problem(server, body, headers, message):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    status, payload = post(server, raw, headers)
    assert status == 400, payload
    assert message in json.loads(payload)["error"]
    valid(server)


def test_binary_bombs_are_refused_before_allocation(server):
    # BYTES: 2**40 elements claimed by 8 bytes of binary data.
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [2**20, 2**20],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    status, payload = post(
        server, header + b"\0" * 8, {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400 and b"claims 1099511627776 elements" in payload
    # A binary size that does not match the shape.
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 3],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    status, payload = post(
        server, header + b"\0" * 8, {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400 and b"needs 12 bytes, got 8" in payload
    valid(server)


def test_an_oversized_body_is_refused_with_413(server):
    status, _ = post(server, b"{" + b" " * 1_100_000 + b"}")
    assert status == 413
    valid(server)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
inputs = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["x", "s", "nope"]) | json_values,
        "datatype": st.sampled_from(["FP32", "BYTES", "INT64", "FP16"]) | json_values,
        "shape": st.lists(st.integers(-2, 2**40), max_size=4) | json_values,
        "data": json_values,
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-4, 64)})
        | json_values,
    },
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "inputs": st.lists(inputs, max_size=3) | json_values,
        "outputs": st.lists(
            st.fixed_dictionaries({}, optional={"name": json_values, "parameters": json_values}),
            max_size=2,
        )
        | json_values,
        "parameters": json_values,
    },
)


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests,
    st.binary(max_size=48),
    st.one_of(st.none(), st.integers(-5, 400).map(str), st.text(max_size=5)),
)
def test_fuzzed_requests_never_get_an_undocumented_status(server, request, tail, header_length):
    body = json.dumps(request).encode()
    headers = {}
    if header_length is not None:
        # http.client itself sends only printable latin-1 header values.
        assume(all(c.isprintable() and ord(c) < 256 for c in header_length))
        headers["Inference-Header-Content-Length"] = header_length
        body += tail
    status, payload = post(server, body, headers)
    assert status in DOCUMENTED, (status, payload[:300])
    assert status != 500


def test_the_server_still_answers_after_the_fuzzing(server):
    valid(server)


def test_a_request_deadline_drops_work_that_waited_too_long_and_priority_is_honoured():
    """Triton's request parameters: ``timeout`` (microseconds) on a queue policy that allows
    overriding it drops a request still queued at its deadline (504, never run), and a
    bad value is a 400."""
    from servekit import QueuePolicy, TimeoutAction
    from servekit.client import Client

    gate, ran = threading.Event(), []

    def slow(d):
        ran.append(float(d["x"][0, 0]))
        gate.wait(10)
        return {"y": d["x"] * 2}

    policy = BatchingPolicy(
        max_batch_size=1,
        default_queue_policy=QueuePolicy(
            timeout_action=TimeoutAction.REJECT, allow_timeout_override=True
        ),
    )
    batcher = Batcher(FunctionRunner(slow, SPEC), policy, name="slow")
    with serving(KServeApp({"slow": batcher})) as url:
        port = int(url.rsplit(":", 1)[1])

        def body(value: float, **parameters) -> bytes:
            return json.dumps(
                {
                    "parameters": parameters,
                    "inputs": [
                        {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [value] * 3},
                        {"name": "s", "datatype": "BYTES", "shape": [1, 1], "data": ["a"]},
                    ],
                }
            ).encode()

        results: dict[str, tuple[int, bytes]] = {}

        def send(key: str, payload: bytes) -> None:
            results[key] = post(port, payload, path="/v2/models/slow/infer")

        try:
            first = threading.Thread(target=send, args=("busy", body(1.0)))
            first.start()
            wait_until(lambda: ran, "the first request holding the only instance", 10)
            late = threading.Thread(target=send, args=("late", body(2.0, timeout=20_000)))
            late.start()
            late.join(10)  # its 20 ms pass while it waits: dropped without running
            gate.set()
            first.join(10)
            assert results["busy"][0] == 200
            assert results["late"][0] == 504 and b"timeout" in results["late"][1].lower()
            assert ran == [1.0]
            status, payload = post(port, body(3.0, timeout=-5), path="/v2/models/slow/infer")
            assert status == 400 and b"parameter 'timeout'" in payload
            status, payload = post(port, body(3.0, priority="high"), path="/v2/models/slow/infer")
            assert status == 400 and b"parameter 'priority'" in payload
            with Client(f"http://127.0.0.1:{port}") as c:
                assert c.infer(
                    "slow",
                    {"x": np.ones((1, 3), np.float32), "s": np.array([[b"a"]], dtype=object)},
                )["y"].shape == (1, 3)
        finally:
            gate.set()
    batcher.close()
