"""Tensors sent as JSON ``data`` are read as tritonserver reads them: each value of the
datatype's kind (numbers for FP*, integers in range for INT* and UINT*, true and false
for BOOL) or a 400 naming the input, the datatype and the value; never a silent cast
(``true`` as 1.0, ``1.5`` as 1, ``-1`` as 255) and never a 500. gRPC's typed contents
are held to the same ranges."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit.errors import InvalidInput
from servekit.protocol.kserve import decode_request
from servekit.spec import as_dtype

NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
           "FP16", "FP32", "FP64"]  # fmt: skip


def body(data: object, datatype: str = "FP32", shape: object = None) -> bytes:
    n = len(data) if isinstance(data, list) else 1
    item = {"name": "x", "datatype": datatype, "shape": [n] if shape is None else shape}
    return json.dumps({"inputs": [{**item, "data": data}]}).encode()


def fits(value: object, datatype: str) -> bool:
    """Whether tritonserver reads ``value`` as an element of ``datatype``."""
    if datatype == "BOOL":
        return type(value) is bool
    dtype = as_dtype(datatype).numpy
    if datatype.startswith(("INT", "UINT")):
        info = np.iinfo(dtype)
        return type(value) is int and info.min <= value <= info.max
    # Past FP32's range a double is inf, as tritonserver's cast makes it (numpy warns);
    # FP16, which tritonserver takes in no JSON, is held to its range.
    top = np.finfo(dtype).max if dtype == np.float16 else np.inf
    return type(value) in (int, float) and abs(value) <= top


values = st.one_of(
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
)


@given(datatype=st.sampled_from(NUMERIC), data=st.lists(values, min_size=1, max_size=6))
def test_a_value_is_taken_only_where_it_is_of_the_datatypes_kind(datatype, data):
    if all(fits(v, datatype) for v in data):
        x = decode_request(body(data, datatype)).inputs["x"]
        assert x.dtype == as_dtype(datatype).numpy
        assert np.array_equal(x, np.array(data).astype(x.dtype))
    else:
        with pytest.raises(InvalidInput, match=f"input 'x': 'data' is not {datatype}"):
            decode_request(body(data, datatype))


@pytest.mark.parametrize(
    ("data", "datatype", "says"),
    [
        ([True, 2.0], "FP32", "it holds true, not a number"),
        ([1.5], "INT32", "it holds 1.5, not an integer"),
        ([1.0], "INT64", "it holds 1.0, not an integer"),
        ([-1], "UINT8", "-1 is outside [0, 255]"),
        ([300], "UINT8", "300 is outside [0, 255]"),
        ([2**63], "INT64", "9223372036854775808 is outside"),
        ([1, 0], "BOOL", "it holds 1, not true or false"),
        ([70000], "FP16", "70000 is outside [-65504, 65504]"),
        ([None], "FP32", "it holds null, not a number"),
        (["1"], "INT32", 'it holds "1", not an integer'),
    ],
)
def test_what_a_refusal_says(data, datatype, says):
    with pytest.raises(InvalidInput) as e:
        decode_request(body(data, datatype))
    assert f"input 'x': 'data' is not {datatype}" in str(e.value) and says in str(e.value)


def test_numbers_json_cannot_hold_are_a_400_naming_them():
    with pytest.raises(InvalidInput, match=r"the number 1e400 does not fit a double"):
        decode_request(b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], '
                       b'"data": [1e400]}]}')  # fmt: skip
    digits = b"9" * 5000  # past Python's 4,300-digit limit: was a 500 (ValueError)
    with pytest.raises(InvalidInput, match="request is not valid JSON"):
        decode_request(b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], '
                       b'"data": [' + digits + b"]}]}")  # fmt: skip
    huge = str(10**400).encode()  # an integer no double holds
    with pytest.raises(InvalidInput, match="input 'x': 'data' is not FP64"):
        decode_request(b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], '
                       b'"data": [' + huge + b"]}]}")  # fmt: skip


def test_nan_and_infinity_are_taken_as_tritonserver_takes_them():
    x = decode_request(body([math.nan, math.inf, -math.inf])).inputs["x"]
    assert np.isnan(x[0]) and x[1] == np.inf and x[2] == -np.inf


def test_a_dimension_or_a_binary_size_of_true_is_refused():
    with pytest.raises(InvalidInput, match=r"'shape' must be a list of non-negative integers"):
        decode_request(body([1.0, 2.0], shape=[True, 2]))
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "UINT8",
                    "shape": [1],
                    "parameters": {"binary_data_size": True},
                }
            ]
        }  # fmt: skip
    ).encode()
    with pytest.raises(
        InvalidInput, match="binary_data_size must be a non-negative integer, got True"
    ):
        decode_request(header + b"\x01", len(header))


@pytest.mark.parametrize(
    ("datatype", "field", "values", "says"),
    [
        ("INT8", "int_contents", [300], "int_contents is not INT8: 300 is outside [-128, 127]"),
        ("UINT16", "uint_contents", [70000], "uint_contents is not UINT16: 70000 is outside"),
    ],
)
def test_over_grpc_typed_contents_past_the_datatypes_range_are_refused(
    datatype, field, values, says
):
    """gRPC's typed contents carry INT8 and INT16 as int32s (UINT8, UINT16 as uint32s):
    a value the tensor cannot hold is refused as in JSON, not wrapped."""
    from tritonclient.grpc import service_pb2

    from servekit.grpc.tensors import decode_inputs

    request = service_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[len(values)])
    getattr(tensor.contents, field).extend(values)
    with pytest.raises(InvalidInput) as e:
        decode_inputs(request)
    assert str(e.value).startswith("input 'x': ") and says in str(e.value)
    del getattr(tensor.contents, field)[:]
    getattr(tensor.contents, field).extend([1])
    assert decode_inputs(request)["x"].tolist() == [1]


def test_over_grpc_contents_beside_a_shared_memory_region_are_refused():
    """As tritonserver does: values sent both ways would leave one of them unread."""
    from tritonclient.grpc import service_pb2

    from servekit.grpc.tensors import decode_inputs

    request = service_pb2.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2])
    tensor.parameters["shared_memory_region"].string_param = "r0"
    tensor.parameters["shared_memory_byte_size"].int64_param = 8
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidInput, match="input 'x': 'contents' given, but its data is in "
                       "shared-memory region 'r0'"):  # fmt: skip
        decode_inputs(request)


@pytest.mark.parametrize(
    ("parameters", "outputs", "says"),
    [
        ({"binary_data_output": "yes"}, None, "request: parameter 'binary_data_output': expected true or false, got 'yes'"),
        ({"binary_data_output": 1}, None, "expected true or false, got 1"),
        (None, [{"name": "y", "parameters": {"binary_data": "no"}}],
         "output 'y': parameter 'binary_data': expected true or false, got 'no'"),
    ],
)  # fmt: skip
def test_binary_flags_are_true_or_false(parameters, outputs, says):
    """``"no"`` was truthy: an output asked for as JSON came back binary."""
    request: dict[str, object] = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                                              "data": [1.0]}]}  # fmt: skip
    if parameters is not None:
        request["parameters"] = parameters
    if outputs is not None:
        request["outputs"] = outputs
    with pytest.raises(InvalidInput, match=says.replace("(", r"\(")):
        decode_request(json.dumps(request).encode())
    request.pop("parameters", None)
    request["outputs"] = [{"name": "y", "parameters": {"binary_data": False}}]
    assert decode_request(json.dumps(request).encode()).json_outputs == {"y"}


def test_a_binary_size_that_is_no_integer_says_so():
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "UINT8",
                    "shape": [1],
                    "parameters": {"binary_data_size": 1.5},
                }
            ]
        }  # fmt: skip
    ).encode()
    with pytest.raises(
        InvalidInput, match="binary_data_size must be a non-negative integer, got 1.5"
    ):
        decode_request(header + b"\x01", len(header))


BAD = [
    ([True] * 16, "it holds true, not a number"),
    ([math.inf] + [0.0] * 15, "does not fit a double"),  # sent as 1e400
    ([None] * 16, "it holds null, not a number"),
]


def test_eight_clients_bad_values_fail_alone_and_the_others_get_their_own_answers(
    add_sub_path,
):
    """Over real HTTP, two of eight clients send values of the wrong kind, in turn with six
    sending good ones into the same batches: each bad request gets its 400, every good one
    its own sums, and nothing is left in the batcher."""
    import urllib.error
    import urllib.request

    from conftest import each_client, serving
    from servekit.batching import Batcher, BatchingPolicy
    from servekit.http.app import KServeApp
    from servekit.runners.onnx import OnnxRuntimeRunner

    runner = OnnxRuntimeRunner(add_sub_path)
    batcher = Batcher(runner, BatchingPolicy(8, (), 2000), name="add_sub")
    wrong: list[str] = []
    try:
        with serving(KServeApp({"add_sub": batcher})) as url:

            def send(data: object, other: list[float]) -> tuple[int, dict]:
                raw = json.dumps({"inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": data},
                    {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": other},
                ]}).replace("Infinity", "1e400").encode()  # fmt: skip
                request = urllib.request.Request(f"{url}/v2/models/add_sub/infer", raw)
                try:
                    with urllib.request.urlopen(request, timeout=30) as r:
                        return r.status, json.loads(r.read())
                except urllib.error.HTTPError as exc:
                    return exc.code, json.loads(exc.read())

            def client(k: int) -> None:
                for i in range(20):
                    other = [float(k * 100 + i)] * 16
                    if k < 2:
                        values, says = BAD[(k + i) % len(BAD)]
                        status, answer = send(values, other)
                        if status != 400 or says not in answer.get("error", ""):
                            wrong.append(f"bad client {k}: {status} {answer}, wanted {says!r}")
                        continue
                    x = [float(j) for j in range(16)]
                    status, answer = send(x, other)
                    sums = next(
                        (o["data"] for o in answer.get("outputs", []) if o["name"] == "OUTPUT0"),
                        None,
                    )
                    if status != 200 or sums != [a + b for a, b in zip(x, other, strict=True)]:
                        wrong.append(f"client {k} request {i}: {status} {answer}")

            each_client(client)
    finally:
        pending = batcher.pending
        batcher.close()
        runner.close()
    assert wrong == []
    assert pending == 0


def test_a_number_no_double_holds_is_named_with_its_input():
    with pytest.raises(InvalidInput, match=r"input 'x': 'data' is not FP32: the number 1e400"):
        decode_request(b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], '
                       b'"data": [1e400]}]}')  # fmt: skip
    with pytest.raises(InvalidInput, match=r"'shape' must be a list of non-negative integers"):
        decode_request(b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1e400], '
                       b'"data": [1.0]}]}')  # fmt: skip


@pytest.mark.parametrize("datatype", NUMERIC)
def test_an_empty_tensor_of_any_datatype_decodes(datatype):
    """No values to check (min() of none was a ValueError: a 500)."""
    x = decode_request(body([], datatype, shape=[1, 0])).inputs["x"]
    assert x.shape == (1, 0) and x.dtype == as_dtype(datatype).numpy
