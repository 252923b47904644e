"""Signatures: the dtype table and request validation (property tests over shapes/dtypes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit import InvalidInput, ModelSpec, RunnerError, TensorSpec, as_dtype
from servekit.spec import DTYPES

NUMERIC = [d for d in DTYPES if d.datatype != "BYTES"]


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.datatype)
def test_dtype_table_round_trips_between_numpy_triton_and_kserve_names(dt):
    assert as_dtype(dt.numpy) is dt
    assert as_dtype(dt.triton) is dt
    assert as_dtype(dt.datatype) is dt
    assert as_dtype(dt.datatype.lower()) is dt


def test_strings_and_fixed_width_bytes_are_bytes():
    assert as_dtype("TYPE_STRING").datatype == "BYTES"
    assert as_dtype(np.dtype("S5")).datatype == "BYTES"
    assert as_dtype(np.dtype("U3")).datatype == "BYTES"
    assert as_dtype(np.float32).triton == "TYPE_FP32"


def test_unknown_dtypes_are_rejected_by_name():
    with pytest.raises(InvalidInput, match="complex64"):
        as_dtype(np.complex64)
    with pytest.raises(InvalidInput, match="FP128"):
        as_dtype("FP128")


def test_tensor_spec_rejects_zero_or_negative_dims():
    with pytest.raises(ValueError, match=r"\[3, 0\]"):
        TensorSpec("x", np.float32, [3, 0])
    with pytest.raises(ValueError, match=r"-2"):
        TensorSpec("x", np.float32, [-2])


def test_model_spec_rejects_duplicate_names_and_negative_batch():
    t = TensorSpec("x", np.float32, [1])
    with pytest.raises(ValueError, match="duplicate"):
        ModelSpec((t, t), (t,), 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        ModelSpec((t,), (t,), -1)


dims = st.lists(st.one_of(st.just(-1), st.integers(1, 4)), min_size=0, max_size=3)


@st.composite
def spec_and_request(draw):
    """A random batched spec and a request that satisfies it."""
    n_inputs = draw(st.integers(1, 3))
    max_batch = draw(st.integers(1, 8))
    rows = draw(st.integers(1, max_batch))
    tensors, arrays = [], {}
    for i in range(n_inputs):
        dt = draw(st.sampled_from(NUMERIC))
        shape = draw(dims)
        concrete = [draw(st.integers(1, 4)) if d == -1 else d for d in shape]
        tensors.append(TensorSpec(f"in{i}", dt.numpy, shape))
        arrays[f"in{i}"] = np.zeros([rows, *concrete], dtype=dt.numpy)
    spec = ModelSpec(tuple(tensors), (TensorSpec("out", np.float32, [1]),), max_batch)
    return spec, arrays, rows


@given(spec_and_request())
def test_valid_requests_pass_and_report_their_batch_size(case):
    spec, arrays, rows = case
    assert spec.validate_inputs(arrays) == rows


@given(spec_and_request(), st.data())
def test_a_wrong_dim_is_rejected_naming_tensor_expected_and_got(case, data):
    spec, arrays, _ = case
    name = data.draw(st.sampled_from(sorted(arrays)))
    t = spec.input(name)
    fixed = [i for i, d in enumerate(t.shape) if d != -1]
    if fixed:
        axis = data.draw(st.sampled_from(fixed))
        shape = list(arrays[name].shape)
        shape[axis + 1] += data.draw(st.integers(1, 3))
    else:  # only variable dims: change the rank instead
        shape = [*arrays[name].shape, 1]
    arrays[name] = np.zeros(shape, dtype=arrays[name].dtype)
    with pytest.raises(InvalidInput) as info:
        spec.validate_inputs(arrays)
    msg = str(info.value)
    assert repr(name) in msg
    assert "[" + ",".join(str(d) for d in shape) + "]" in msg
    assert "[-1," + ",".join(str(d) for d in t.shape) in msg or t.shape == ()


@given(spec_and_request(), st.data())
def test_a_wrong_dtype_is_rejected_naming_expected_and_got(case, data):
    spec, arrays, _ = case
    name = data.draw(st.sampled_from(sorted(arrays)))
    want = spec.input(name).dtype
    other = data.draw(st.sampled_from([d for d in NUMERIC if d != want]))
    arrays[name] = arrays[name].astype(other.numpy)
    with pytest.raises(
        InvalidInput, match=f"'{name}': expected dtype {want.datatype}, got {other.datatype}"
    ):
        spec.validate_inputs(arrays)


@given(spec_and_request())
def test_batches_over_max_batch_size_are_rejected(case):
    spec, arrays, _ = case
    big = spec.max_batch_size + 1
    arrays = {k: np.zeros((big, *a.shape[1:]), a.dtype) for k, a in arrays.items()}
    with pytest.raises(
        InvalidInput, match=f"batch size {big} exceeds max_batch_size {spec.max_batch_size}"
    ):
        spec.validate_inputs(arrays)


def two_input_spec() -> ModelSpec:
    return ModelSpec(
        (TensorSpec("a", np.float32, [2]), TensorSpec("b", np.float32, [2])),
        (TensorSpec("y", np.float32, [2]),),
        max_batch_size=8,
    )


def test_inputs_with_different_batch_sizes_are_rejected():
    with pytest.raises(InvalidInput, match="batch size 3 differs from the other inputs' 2"):
        two_input_spec().validate_inputs(
            {"a": np.zeros((2, 2), np.float32), "b": np.zeros((3, 2), np.float32)}
        )


def test_missing_and_unexpected_inputs_are_named():
    spec = two_input_spec()
    with pytest.raises(InvalidInput, match=r"missing input\(s\) \['b'\]"):
        spec.validate_inputs({"a": np.zeros((1, 2), np.float32)})
    with pytest.raises(InvalidInput, match=r"unexpected input\(s\) \['c'\]"):
        spec.validate_inputs({k: np.zeros((1, 2), np.float32) for k in "abc"})


def test_empty_batches_and_non_arrays_are_rejected():
    spec = two_input_spec()
    with pytest.raises(InvalidInput, match="batch size must be >= 1, got 0"):
        spec.validate_inputs({"a": np.zeros((0, 2), np.float32), "b": np.zeros((0, 2), np.float32)})
    with pytest.raises(InvalidInput, match="expected a numpy array, got list"):
        spec.validate_inputs({"a": [[1.0, 2.0]], "b": np.zeros((1, 2), np.float32)})


def test_unbatched_specs_check_the_full_shape():
    spec = ModelSpec((TensorSpec("x", np.int64, [3, -1]),), (TensorSpec("y", np.int64, [3]),))
    assert spec.validate_inputs({"x": np.zeros((3, 7), np.int64)}) == 1
    with pytest.raises(InvalidInput, match=r"expected shape \[3,-1\], got \[4,7\]"):
        spec.validate_inputs({"x": np.zeros((4, 7), np.int64)})


def test_bytes_inputs_accept_object_and_fixed_width_arrays():
    spec = ModelSpec((TensorSpec("s", "BYTES", [1]),), (TensorSpec("y", np.int64, [1]),), 4)
    assert spec.validate_inputs({"s": np.array([[b"ab"], [b"c"]], dtype=object)}) == 2
    assert spec.validate_inputs({"s": np.array([[b"ab"]])}) == 1
    with pytest.raises(InvalidInput, match="expected dtype BYTES, got FP32"):
        spec.validate_inputs({"s": np.zeros((1, 1), np.float32)})


def test_runner_outputs_are_checked_as_runner_errors():
    spec = two_input_spec()
    spec.check_outputs({"y": np.zeros((3, 2), np.float32)}, rows=3)
    with pytest.raises(RunnerError, match="no output 'y'"):
        spec.check_outputs({}, rows=1)
    with pytest.raises(RunnerError, match="expected 3 rows for 3 input rows, got 2"):
        spec.check_outputs({"y": np.zeros((2, 2), np.float32)}, rows=3)
    with pytest.raises(RunnerError, match="expected dtype FP32"):
        spec.check_outputs({"y": np.zeros((3, 2), np.float64)}, rows=3)


@given(spec_and_request(), st.integers(1, 8))
def test_sample_inputs_always_satisfy_their_spec(case, n):
    spec, _, _ = case
    n = min(n, spec.max_batch_size)
    assert spec.validate_inputs(spec.sample_inputs(n)) == n
