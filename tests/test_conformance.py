"""Protocol conformance: the same KServe v2 / Triton HTTP cases against every runtime's
public HTTP port.

Well-formed requests get answers equal to the model run in-process; malformed ones a
4xx naming the problem; nothing gets a 5xx, a reset connection or a dead server, and a
correct request is answered after each case. The runtimes that expose tritonserver's
own HTTP port (``--no-front``) deviate where Triton itself does: those cases are listed
in ``DEVIATIONS`` with the reason, as docs/protocol.md's table says, and are expected to fail
there (strictly: if Triton changes, the table must too).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import importlib
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from conftest import serving
from servekit.batching import Batcher, BatchingPolicy
from servekit.bench.compare import ServerProcess
from servekit.config import ModelConfig, ServeConfig, ServerConfig
from servekit.http.app import KServeApp
from servekit.runners.onnx import OnnxRuntimeRunner

MODEL = "add_sub"
POLICY = BatchingPolicy(max_batch_size=8, max_queue_delay_us=100)
LIMIT = 4 * 1024 * 1024
"""The front's request body limit in these runs (``ServerConfig.max_body_bytes``)."""

RUNTIMES = [
    "inprocess",
    "native",
    "pytriton",
    "pytriton-own",
    "triton",
    "triton-own",
    "ray",
]
"""``inprocess``: KServeApp over a Batcher under uvicorn; ``-own``: tritonserver's own
HTTP port (``front = false``); the others servekit's front on ``servekit serve``."""

TRITONSERVER = {
    "invalid json": "tritonserver answers 500 to a body that is not JSON",
    "shape mismatch": "tritonserver answers 500 when 'data' does not fill the shape",
    "null data": "tritonserver answers 500 to null in FP32 data",
    "bool in FP32 data": "tritonserver answers 500 to true in FP32 data",
    "binary flag not a boolean": 'tritonserver answers 500 to binary_data_output "yes"',
    "too big for a double": "tritonserver answers 500 to 1e400",
    "nested too deep": "tritonserver 2.51 flattens 'data' nested more than 100 levels deep (200)",
    "repository index nested too deep": "tritonserver 2.51 answers 500 to an index body nested "
    "200 levels deep",
    "duplicate outputs": "tritonserver answers an output requested twice, twice (200)",
    "unknown datatype": "tritonserver's 400 names the input, not the datatype it got",
    "unsupported encoding": "tritonserver answers 501 to Content-Encoding br",
    "binary precedence": "tritonserver ignores binary_data_output for an output listed "
    "without a binary_data of its own",
}
PYTRITON_TOKEN = (
    "PyTriton guards the repository index and shared-memory APIs with its control token (403)"
)
DEVIATIONS: dict[str, dict[str, str]] = {
    "triton-own": TRITONSERVER,
    "pytriton-own": {  # PyTriton's token answers the deep index body first (403)
        **{k: v for k, v in TRITONSERVER.items() if k != "repository index nested too deep"},
        "repository index": PYTRITON_TOKEN,
        "wrong method on the index": PYTRITON_TOKEN,
        "wrong method on shared memory": PYTRITON_TOKEN,
        "shared memory status": PYTRITON_TOKEN,
    },
}
"""Runtime -> case -> why tritonserver's own HTTP port fails it; docs/protocol.md's conformance
table says the same (``test_the_readme_lists_every_deviation``)."""


@dataclass
class Endpoint:
    runtime: str
    host: str
    port: int
    grpc_port: int | None = None
    """None where the runtime has no gRPC port (in-process, Ray)."""

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        connection: http.client.HTTPConnection | None = None,
    ) -> tuple[int, bytes, dict[str, str]]:
        conn = connection or http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
        finally:
            if connection is None:
                conn.close()

    def infer(self, body: Any, headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, payload, _ = self.request(
            "POST",
            f"/v2/models/{MODEL}/infer",
            raw,
            {"content-type": "application/json", **(headers or {})},
            **kw,
        )
        try:
            return status, json.loads(payload)
        except ValueError:
            return status, payload


def _served(runtime: str) -> contextlib.AbstractContextManager[tuple[str, int, int | None]]:
    @contextlib.contextmanager
    def run() -> Iterator[tuple[str, int, int | None]]:
        name = runtime.removesuffix("-own")
        config = ServeConfig(
            (ModelConfig(MODEL, batching=POLICY, threads=1),),
            ServerConfig(
                front=not runtime.endswith("-own"), max_body_bytes=LIMIT, exit_timeout_s=2
            ),
            runtime=name,
        ).on_loopback()
        with ServerProcess(config) as server:
            server.wait_ready([MODEL])
            grpc = None if name == "ray" else config.server.grpc_port
            yield "127.0.0.1", config.server.http_port, grpc

    return run()


@contextlib.contextmanager
def _inprocess(add_sub_path) -> Iterator[tuple[str, int, int | None]]:
    runner = OnnxRuntimeRunner(add_sub_path, intra_op_threads=1)
    batcher = Batcher(runner, POLICY, name=MODEL)
    try:
        with serving(KServeApp({MODEL: batcher}, max_body_bytes=LIMIT)) as url:
            host, port = url.removeprefix("http://").split(":")
            yield host, int(port), None
    finally:
        batcher.close()
        runner.close()


@pytest.fixture(scope="module", params=RUNTIMES)
def endpoint(request, add_sub_path) -> Iterator[Endpoint]:
    context = _inprocess(add_sub_path) if request.param == "inprocess" else _served(request.param)
    with context as (host, port, grpc):
        yield Endpoint(request.param, host, port, grpc)


A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 0.5, dtype=np.float32)


def well_formed(**extra: Any) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": A.ravel().tolist()},
            {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": B.ravel().tolist()},
        ],
        **extra,
    }


def outputs(answer: dict[str, Any]) -> dict[str, np.ndarray]:
    return {
        o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])
        for o in answer["outputs"]
    }


def case(name: str):
    """Mark a test as conformance case ``name``: expected to fail on tritonserver's own port
    when ``DEVIATIONS`` lists it."""

    def wrap(fn):
        fn.case = name
        return fn

    return wrap


@pytest.fixture(autouse=True)
def _deviation_and_liveness(request, endpoint: Endpoint):
    why = DEVIATIONS.get(endpoint.runtime, {}).get(getattr(request.function, "case", ""))
    if why:
        request.applymarker(pytest.mark.xfail(reason=why, strict=True))
    yield
    # Whatever the case did, the server still answers a correct request correctly.
    status, answer = endpoint.infer(well_formed())
    assert status == 200, answer
    np.testing.assert_allclose(outputs(answer)["OUTPUT0"], A + B)


# --- well-formed requests --------------------------------------------------------------


@case("health")
def test_health_and_server_metadata(endpoint: Endpoint):
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready"):
        assert endpoint.request("GET", path)[0] == 200, path
    status, body, _ = endpoint.request("GET", "/v2")
    meta = json.loads(body)
    assert status == 200 and meta["name"] and meta["version"]
    assert {"binary_tensor_data", "classification", "statistics", "model_configuration"} <= set(
        meta["extensions"]
    )


@case("metadata")
def test_model_metadata(endpoint: Endpoint):
    status, body, _ = endpoint.request("GET", f"/v2/models/{MODEL}")
    meta = json.loads(body)
    assert status == 200 and meta["name"] == MODEL
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("INPUT0", "FP32", [-1, 16]),
        ("INPUT1", "FP32", [-1, 16]),
    ]


@case("unknown version")
def test_an_unknown_version_is_not_found(endpoint: Endpoint):
    status, body, _ = endpoint.request("GET", f"/v2/models/{MODEL}/versions/7")
    assert 400 <= status < 500 and b"7" in body


@case("json infer")
def test_json_inference_equals_the_model_in_process(endpoint: Endpoint):
    status, answer = endpoint.infer(well_formed(id="req-1"))
    assert status == 200, answer
    got = outputs(answer)
    np.testing.assert_allclose(got["OUTPUT0"], A + B)
    np.testing.assert_allclose(got["OUTPUT1"], A - B)
    assert answer["id"] == "req-1" and answer["model_name"] == MODEL


@case("chunked body")
def test_a_chunked_request_body_is_read_whole(endpoint: Endpoint):
    """No Content-Length: Transfer-Encoding chunked, in small pieces."""
    raw = json.dumps(well_formed()).encode()
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=60)
    try:
        pieces = (raw[i : i + 100] for i in range(0, len(raw), 100))
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=pieces, encode_chunked=True)
        answer = conn.getresponse()
        assert answer.status == 200
        np.testing.assert_allclose(outputs(json.loads(answer.read()))["OUTPUT0"], A + B)
    finally:
        conn.close()


@case("nested data")
def test_data_nested_up_to_the_rank_is_accepted(endpoint: Endpoint):
    body = well_formed()
    body["inputs"][0]["data"] = A.tolist()  # [[...16]]: nested as deep as the shape
    status, answer = endpoint.infer(body)
    assert status == 200, answer
    np.testing.assert_allclose(outputs(answer)["OUTPUT0"], A + B)


def nested(data: list[Any], depth: int) -> list[Any]:
    """``data`` wrapped in lists until it is ``depth`` levels deep."""
    for _ in range(depth - 1):
        data = [data]
    return data


@case("nested 50 deep")
def test_data_nested_50_levels_deep_is_flattened_as_triton_does(endpoint: Endpoint):
    """Triton's own QA (``test_json_recursion_depth_limit``): nesting is not the rank."""
    body = well_formed()
    body["inputs"][0]["data"] = nested(A.ravel().tolist(), 50)
    status, answer = endpoint.infer(body)
    assert status == 200, answer
    np.testing.assert_allclose(outputs(answer)["OUTPUT0"], A + B)


@case("repository index nested too deep")
def test_a_repository_index_body_nested_too_deep_is_refused(endpoint: Endpoint):
    """Triton's own QA (``test_repository_index_deeply_nested_json``)."""
    body = json.dumps({"ready": nested([True], 200)}).encode()
    status, answer, _ = endpoint.request("POST", "/v2/repository/index", body)
    assert 400 <= status < 500, (status, answer)


@case("binary precedence")
def test_an_outputs_own_binary_data_false_wins(endpoint: Endpoint):
    body = well_formed(
        parameters={"binary_data_output": True},
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}],
    )
    raw = json.dumps(body).encode()
    status, payload, headers = endpoint.request(
        "POST", f"/v2/models/{MODEL}/infer", raw, {"content-type": "application/json"}
    )
    assert status == 200, payload
    length = int(headers["inference-header-content-length"])
    header = json.loads(payload[:length])
    first, second = header["outputs"]
    assert first["name"] == "OUTPUT0" and "data" in first
    assert second["parameters"]["binary_data_size"] == 64
    np.testing.assert_allclose(np.frombuffer(payload[length:], np.float32), (A - B).ravel())


@case("classification")
def test_the_classification_extension_answers_the_top_k(endpoint: Endpoint):
    body = well_formed(outputs=[{"name": "OUTPUT0", "parameters": {"classification": 2}}])
    status, answer = endpoint.infer(body)
    assert status == 200, answer
    (out,) = answer["outputs"]
    assert out["datatype"] == "BYTES" and out["shape"] == [1, 2]
    values = [(float(v.split(":")[0]), int(v.split(":")[1])) for v in out["data"]]
    assert values == [(15.5, 15), (14.5, 14)]


@case("compression")
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_request_bodies(endpoint: Endpoint, encoding: str):
    raw = json.dumps(well_formed()).encode()
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    status, answer = endpoint.infer(packed, {"content-encoding": encoding})
    assert status == 200, answer
    np.testing.assert_allclose(outputs(answer)["OUTPUT1"], A - B)


@case("model config")
def test_model_configuration_says_the_policy_in_force(endpoint: Endpoint):
    status, body, _ = endpoint.request("GET", f"/v2/models/{MODEL}/config")
    config = json.loads(body)
    assert status == 200, body
    assert config["name"] == MODEL and config["max_batch_size"] == 8
    assert int(config["dynamic_batching"].get("max_queue_delay_microseconds", 0)) == 100
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]


@case("statistics")
def test_statistics_count_the_inferences(endpoint: Endpoint):
    def count() -> int:
        status, body, _ = endpoint.request("GET", f"/v2/models/{MODEL}/stats")
        assert status == 200, body
        (stats,) = [s for s in json.loads(body)["model_stats"] if s["name"] == MODEL]
        return int(stats["inference_stats"]["success"]["count"])

    before = count()
    for _ in range(3):
        assert endpoint.infer(well_formed())[0] == 200
    assert count() >= before + 3


def wrong_method(endpoint: Endpoint, method: str, path: str, allow: str) -> None:
    status, body, headers = endpoint.request(method, path, b"{}" if method != "GET" else None)
    assert status == 405, (status, body)
    if not endpoint.runtime.endswith("-own"):  # tritonserver's own 405 names no methods
        assert allow in headers.get("allow", ""), headers
    assert endpoint.request("GET", "/v2/health/live")[0] == 200


@case("wrong method")
@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("POST", "/v2/health/live", "GET"), ("HEAD", "/v2/health/ready", "GET"),
     ("PUT", "/v2/models/stats", "GET"), ("DELETE", "/v2", "GET"),
     ("GET", f"/v2/models/{MODEL}/infer", "POST"), ("POST", f"/v2/models/{MODEL}/ready", "GET")],
)  # fmt: skip
def test_a_path_asked_with_a_method_it_does_not_take_is_a_405(
    endpoint: Endpoint, method, path, allow
):
    wrong_method(endpoint, method, path, allow)


@case("wrong method on the index")
def test_the_repository_index_asked_with_get_is_a_405(endpoint: Endpoint):
    wrong_method(endpoint, "GET", "/v2/repository/index", "POST")


@case("wrong method on shared memory")
def test_shared_memory_asked_with_the_wrong_method_is_a_405(endpoint: Endpoint):
    wrong_method(endpoint, "POST", "/v2/systemsharedmemory/status", "GET")
    wrong_method(endpoint, "GET", "/v2/cudasharedmemory/region/r/unregister", "POST")


@case("repository index")
def test_the_repository_index_lists_the_model(endpoint: Endpoint):
    status, body, _ = endpoint.request("POST", "/v2/repository/index", b"{}")
    assert status == 200, body
    assert MODEL in [m["name"] for m in json.loads(body)]


@case("shared memory status")
def test_system_shared_memory_status_answers(endpoint: Endpoint):
    status, body, _ = endpoint.request("GET", "/v2/systemsharedmemory/status")
    assert status == 200 and isinstance(json.loads(body), list)


# --- malformed requests: a 4xx naming the problem ---------------------------------------

MALFORMED = {
    "invalid json": (b'{"inputs": [', "JSON"),
    "unknown datatype": (
        {"inputs": [{"name": "INPUT0", "datatype": "FP99", "shape": [1, 16], "data": [0] * 16}]},
        "FP99",
    ),
    "shape mismatch": (
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 3}]},
        "INPUT0",
    ),
    "null data": (
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [None] * 16},
                {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16},
            ]
        },
        "INPUT0",
    ),
    "bool in FP32 data": (
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [True] * 16},
                {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16},
            ]
        },
        "INPUT0",
    ),
    "too big for a double": (
        b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1e400]}]}',
        "1e400",
    ),
    "nested too deep": (
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [1, 16],
                    "data": nested([0.0] * 16, 101),
                },
                {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16},
            ]
        },
        "INPUT0",
    ),
    "duplicate outputs": (
        well_formed(outputs=[{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]),
        "OUTPUT0",
    ),
    "reserved parameter": (well_formed(parameters={"triton_secret": 1}), "triton_"),
    "binary flag not a boolean": (
        well_formed(parameters={"binary_data_output": "yes"}),
        "binary_data_output",
    ),
    "unknown output": (well_formed(outputs=[{"name": "OUTPUT9"}]), "OUTPUT9"),
    "missing input": (
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]},
        "INPUT1",
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_requests_get_a_4xx_naming_the_problem(endpoint: Endpoint, name: str, request):
    why = DEVIATIONS.get(endpoint.runtime, {}).get(name)
    if why:
        request.applymarker(pytest.mark.xfail(reason=why, strict=True))
    body, needle = MALFORMED[name]
    status, answer = endpoint.infer(body)
    assert 400 <= status < 500, (status, answer)
    assert needle in json.dumps(answer), answer


def _int_contents(request: Any) -> None:
    request.inputs[0].contents.int_contents.extend([1] * 16)


def _contents_and_raw(request: Any) -> None:
    request.raw_input_contents.extend([A.tobytes(), B.tobytes()])


GRPC_MALFORMED = {
    "contents of another datatype": _int_contents,
    "contents beside raw_input_contents": _contents_and_raw,
}
"""gRPC requests whose values would be dropped unsaid if read as sent: tritonserver
refuses each (INVALID_ARGUMENT naming the input), and so does every gRPC port here."""


@pytest.mark.parametrize("name", sorted(GRPC_MALFORMED))
def test_malformed_grpc_requests_are_invalid_argument_naming_the_input(
    endpoint: Endpoint, name: str
):
    if endpoint.grpc_port is None:
        pytest.skip(f"{endpoint.runtime} serves no gRPC")
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def adder() -> Any:
        request = service_pb2.ModelInferRequest(model_name=MODEL)
        for input_name, values in (("INPUT0", A), ("INPUT1", B)):
            tensor = request.inputs.add(name=input_name, datatype="FP32", shape=[1, 16])
            tensor.contents.fp32_contents.extend(values.ravel().tolist())
        return request

    bad = adder()
    GRPC_MALFORMED[name](bad)
    with grpc.insecure_channel(f"{endpoint.host}:{endpoint.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(bad, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "INPUT0" in e.value.details(), e.value.details()
        answer = stub.ModelInfer(adder(), timeout=30)  # and the next call is answered
        assert {o.name for o in answer.outputs} == {"OUTPUT0", "OUTPUT1"}


@case("unsupported encoding")
def test_an_encoding_the_server_cannot_decode_is_refused(endpoint: Endpoint):
    raw = json.dumps(well_formed()).encode()
    status, answer = endpoint.infer(raw, {"content-encoding": "br"})
    assert 400 <= status < 500 and "br" in json.dumps(answer), (status, answer)
    status, answer = endpoint.infer(raw, {"content-encoding": "gzip"})  # not gzip at all
    assert 400 <= status < 500 and "gzip" in json.dumps(answer), (status, answer)


@case("raw body, two inputs")
def test_a_raw_binary_body_for_a_two_input_model_is_refused(endpoint: Endpoint):
    status, answer = endpoint.infer(A.tobytes(), {"inference-header-content-length": "0"})
    assert 400 <= status < 500, (status, answer)


# --- answered after reading: a status, never a reset ------------------------------------


@case("early answers")
@pytest.mark.parametrize(
    ("path", "size", "expected"),
    [
        ("/v2/models/nope/infer", 6_000_000, (400, 404)),
        (f"/v2/models/{MODEL}/infer", 6_000_000, (400, 413)),
    ],
)
def test_early_answers_reach_the_client_over_keep_alive(endpoint: Endpoint, path, size, expected):
    """A multi-megabyte body for an unknown model, or over the front's limit: the client
    reads the status, and the same connection serves the next request."""
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=60)
    try:
        body = b'{"inputs": []' + b" " * (size - 14) + b"}"
        status, payload, _ = endpoint.request(
            "POST", path, body, {"content-type": "application/json"}, connection=conn
        )
        assert status in expected, payload
        status, _, _ = endpoint.request("GET", "/v2/health/live", connection=conn)
        assert status == 200
    finally:
        conn.close()


# --- the tritonclient matrix -------------------------------------------------------------


def _inputs(module: Any, binary: bool = True) -> list[Any]:
    out = []
    for name, value in (("INPUT0", A), ("INPUT1", B)):
        tensor = module.InferInput(name, [1, 16], "FP32")
        if ".http" in module.__name__:
            tensor.set_data_from_numpy(value, binary_data=binary)
        else:
            tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def _sync_calls(module: Any, client: Any, http: bool) -> dict[str, Any]:
    """Every call a user makes, each returning something checkable."""

    def infer(**kw: Any) -> Any:
        result = client.infer(MODEL, _inputs(module, kw.pop("binary", True)), **kw)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), A + B)
        return result

    def classify() -> Any:
        outputs = [module.InferRequestedOutput("OUTPUT0", class_count=2)]
        result = client.infer(MODEL, _inputs(module), outputs=outputs)
        top = result.as_numpy("OUTPUT0").reshape(-1)
        assert [int(v.split(b":")[1]) for v in top] == [15, 14]
        return top

    def async_infer() -> Any:
        if http:
            return client.async_infer(MODEL, _inputs(module)).get_result()
        import queue

        answers: queue.Queue = queue.Queue()
        client.async_infer(
            MODEL, _inputs(module), lambda result, error: answers.put((result, error))
        )
        result, error = answers.get(timeout=30)
        if error is not None:
            raise error
        return result

    def stats() -> Any:
        kw = {} if http else {"as_json": True}
        s = client.get_inference_statistics(MODEL, **kw)
        assert MODEL in json.dumps(s)
        return s

    def true(value: bool, what: str) -> bool:
        assert value, what
        return value

    calls: dict[str, Any] = {
        "is_server_live": lambda: true(client.is_server_live(), "not live"),
        "is_model_ready": lambda: true(client.is_model_ready(MODEL), "not ready"),
        "get_server_metadata": client.get_server_metadata,
        "get_model_metadata": lambda: client.get_model_metadata(MODEL),
        "get_model_config": lambda: client.get_model_config(MODEL),
        "get_inference_statistics": stats,
        "infer (binary tensors)": infer,
        "infer (class_count)": classify,
        "async_infer": async_infer,
        "get_system_shared_memory_status": client.get_system_shared_memory_status,
        "get_model_repository_index": client.get_model_repository_index,
    }
    if http:
        calls["infer (JSON tensors)"] = lambda: infer(binary=False)
        calls["infer (gzip request)"] = lambda: infer(request_compression_algorithm="gzip")
        calls["infer (deflate request)"] = lambda: infer(request_compression_algorithm="deflate")
    else:
        calls["infer (gzip)"] = lambda: infer(compression_algorithm="gzip")
    return calls


MATRIX_CALLS = [
    "is_server_live",
    "is_model_ready",
    "get_server_metadata",
    "get_model_metadata",
    "get_model_config",
    "get_inference_statistics",
    "infer (JSON tensors)",
    "infer (binary tensors)",
    "infer (gzip request)",
    "infer (deflate request)",
    "infer (gzip)",
    "infer (class_count)",
    "async_infer",
    "get_system_shared_memory_status",
    "get_model_repository_index",
    "aio: get_model_config",
    "aio: get_inference_statistics",
    "aio: infer",
]


async def _aio_calls(module: Any, client: Any, http: bool) -> dict[str, str]:
    """The asyncio clients (``tritonclient.http.aio``, ``tritonclient.grpc.aio``)."""

    async def infer() -> None:
        result = await client.infer(MODEL, _inputs(module))
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), A - B)

    async def stats() -> None:
        kw = {} if http else {"as_json": True}
        assert MODEL in json.dumps(await client.get_inference_statistics(MODEL, **kw))

    calls = {
        "aio: get_model_config": lambda: client.get_model_config(MODEL),
        "aio: get_inference_statistics": stats,
        "aio: infer": infer,
    }
    results = {}
    for call, fn in calls.items():
        try:
            await fn()
            results[call] = "ok"
        except Exception as exc:  # the matrix records what a user would see
            results[call] = f"{type(exc).__name__}: {exc}"[:200]
    await client.close()
    return results


def run_matrix(endpoint: Endpoint) -> dict[tuple[str, str], str]:
    """(protocol, call) -> ``ok`` or the error, for tritonclient over HTTP and gRPC."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    results: dict[tuple[str, str], str] = {}
    protocols = [("HTTP", httpclient, endpoint.port)]
    if endpoint.grpc_port is not None:
        protocols.append(("gRPC", grpcclient, endpoint.grpc_port))
    for protocol, module, port in protocols:
        client = module.InferenceServerClient(f"{endpoint.host}:{port}")
        try:
            for call, fn in _sync_calls(module, client, protocol == "HTTP").items():
                try:
                    fn()
                    results[protocol, call] = "ok"
                except Exception as exc:  # the matrix records what a user would see
                    results[protocol, call] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            client.close()
        aio = importlib.import_module(f"{module.__name__}.aio")

        async def run(
            aio: Any = aio, port: int = port, http: bool = protocol == "HTTP"
        ) -> dict[str, str]:
            return await _aio_calls(aio, aio.InferenceServerClient(f"{endpoint.host}:{port}"), http)

        for call, result in asyncio.run(run()).items():
            results[protocol, call] = result
    return results


def documented_table(marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the docs/protocol.md table after ``<!-- marker -->``."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    section = text.split(f"<!-- {marker} -->")[1].split("<!-- end -->")[0]
    rows = [r for r in section.strip().splitlines() if r.startswith("|")]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]


def readme_matrix() -> dict[tuple[str, str], dict[str, str]]:
    """docs/protocol.md's tritonclient matrix: (protocol, call) -> runtime -> cell."""
    header, _, *rows = documented_table("tritonclient matrix")
    return {(r[0], r[1]): dict(zip(header[2:], r[2:], strict=True)) for r in rows}


def test_the_readme_lists_every_deviation():
    """docs/protocol.md's deviation table is ``DEVIATIONS``: case, runtimes, reason."""
    _, _, *rows = documented_table("conformance deviations")
    listed = {(r[0], rt.strip()): r[2] for r in rows for rt in r[1].replace("`", "").split(",")}
    expected = {(case, rt): why for rt, cases in DEVIATIONS.items() for case, why in cases.items()}
    assert listed == expected


def test_the_tritonclient_matrix_is_the_readmes(endpoint: Endpoint):
    """Every tritonclient call over HTTP and gRPC; docs/protocol.md's matrix says ok, n/a (no such
    port) or why not, and must match what happens."""
    got = run_matrix(endpoint)
    expected = readme_matrix()
    mismatches = []
    for (protocol, call), cells in expected.items():
        cell = cells[endpoint.runtime]
        result = got.get((protocol, call))
        if result is None:
            if cell != "n/a":
                mismatches.append(
                    f"{protocol} {call}: docs/protocol.md says {cell!r}, not run here"
                )
        elif (result == "ok") != (cell == "ok"):
            mismatches.append(f"{protocol} {call}: docs/protocol.md says {cell!r}, got {result!r}")
    missing = [key for key in got if key not in expected]
    assert not mismatches and not missing, (mismatches, missing)
