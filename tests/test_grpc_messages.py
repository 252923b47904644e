"""``ModelInferRequest``: a ``ModelInferRequest`` read with its tensors' bytes left in place,
equal to protobuf's own reading of the same message, and refusing what protobuf refuses."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from servekit.grpc.tensors import ModelInferRequest


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(max_size=300), max_size=4),
    st.text(max_size=20),
    st.integers(0, 2**62),
    st.lists(st.integers(0, 2**20), max_size=3),
)
def test_it_reads_what_protobuf_reads_and_leaves_the_raw_contents_in_place(
    raws, name, sequence, shape
):
    message = service_pb2.ModelInferRequest(model_name=name, id="r1", raw_input_contents=raws)
    message.parameters["sequence_id"].int64_param = sequence
    message.inputs.add(name="x", datatype="FP32", shape=shape)
    message.outputs.add(name="y")
    data = b"\x00\x00\x00\x00\x00" + message.SerializeToString()
    view = memoryview(data)[5:]  # as the server hands it over: past the gRPC prefix
    request = ModelInferRequest.FromString(view)
    assert [bytes(r) for r in request.raw_input_contents] == raws
    assert all(r.obj is data for r in request.raw_input_contents)  # views, not copies
    assert request.model_name == name and request.id == "r1"
    assert request.parameters["sequence_id"].int64_param == sequence
    assert list(request.inputs[0].shape) == shape and request.outputs[0].name == "y"


@pytest.mark.parametrize(
    "data",
    [b"\x3a\x10short", b"\x3a", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b"],
    ids=["raw past the end", "no length", "overlong varint", "wire type 3"],
)
def test_a_message_protobuf_cannot_read_is_refused_the_same_way(data):
    with pytest.raises(DecodeError):
        ModelInferRequest.FromString(data)
