"""Runners: the ONNX Runtime runner against onnx's independent reference evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from servekit import (
    FunctionRunner,
    InvalidInput,
    ModelSpec,
    OnnxRuntimeRunner,
    Runner,
    RunnerError,
    TensorSpec,
)
from servekit.runners.onnx import DEFAULT_MAX_BATCH_SIZE
from servekit.zoo._onnx import FLOAT, GraphBuilder


def test_spec_is_read_from_the_graph_with_a_dynamic_batch_dim(tiny_cnn_path):
    with OnnxRuntimeRunner(tiny_cnn_path) as runner:
        spec = runner.spec
    assert spec.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert spec.inputs == (TensorSpec("input", np.float32, [3, 32, 32]),)
    assert spec.outputs == (TensorSpec("logits", np.float32, [10]),)


def test_max_batch_size_can_be_set_or_batching_turned_off(add_sub_path):
    assert OnnxRuntimeRunner(add_sub_path, max_batch_size=8).spec.max_batch_size == 8
    unbatched = OnnxRuntimeRunner(add_sub_path, max_batch_size=0).spec
    assert unbatched.max_batch_size == 0
    assert unbatched.inputs[0].shape == (-1, 16)


def test_static_and_variable_dims_map_to_triton_dims():
    g = GraphBuilder()
    g.node("Identity", ["x"], "y")
    model = g.model("m", [("x", FLOAT, [2, "len"])], [("y", FLOAT, [2, "len"])])
    spec = OnnxRuntimeRunner(model.SerializeToString()).spec
    assert spec.max_batch_size == 0  # leading dim is static: no implicit batch
    assert spec.inputs[0].shape == (2, -1)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_tiny_cnn_matches_the_reference_evaluator(tiny_cnn_path, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    expected = ReferenceEvaluator(onnx.load(tiny_cnn_path)).run(None, {"input": x})[0]
    with OnnxRuntimeRunner(tiny_cnn_path, intra_op_threads=1) as runner:
        got = runner.infer({"input": x})["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_add_sub_matches_numpy(add_sub_path):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((5, 16)).astype(np.float32) for _ in range(2))
    out = OnnxRuntimeRunner(add_sub_path).infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_non_contiguous_inputs_give_the_same_result(tiny_cnn_path):
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    strided = np.asfortranarray(x)
    assert not strided.flags.c_contiguous
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    np.testing.assert_array_equal(
        runner.infer({"input": strided})["logits"], runner.infer({"input": x})["logits"]
    )


def test_inputs_are_validated_before_the_engine_runs(tiny_cnn_path):
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    with pytest.raises(
        InvalidInput, match=r"'input': expected shape \[-1,3,32,32\].*got \[1,3,32,31\]"
    ):
        runner.infer({"input": np.zeros((1, 3, 32, 31), np.float32)})
    with pytest.raises(InvalidInput, match="'input': expected dtype FP32, got FP64"):
        runner.infer({"input": np.zeros((1, 3, 32, 32))})


def test_bad_optimization_level_is_named(tiny_cnn_path):
    with pytest.raises(ValueError, match="'fastest'"):
        OnnxRuntimeRunner(tiny_cnn_path, optimization_level="fastest")


SPEC = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [2]),), 4)


def test_function_runner_satisfies_the_runner_protocol():
    runner = FunctionRunner(lambda d: {"y": d["x"] * 2}, SPEC)
    assert isinstance(runner, Runner)
    x = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(runner.infer({"x": x})["y"], x * 2)
    runner.warmup((1, 4))


def test_engine_exceptions_become_runner_errors_naming_the_cause():
    def boom(_):
        raise ZeroDivisionError("kaboom")

    with pytest.raises(RunnerError, match="ZeroDivisionError: kaboom"):
        FunctionRunner(boom, SPEC).infer({"x": np.ones((1, 2), np.float32)})


def test_outputs_with_the_wrong_row_count_are_runner_errors():
    runner = FunctionRunner(lambda d: {"y": d["x"][:1]}, SPEC)
    with pytest.raises(RunnerError, match="expected 3 rows"):
        runner.infer({"x": np.ones((3, 2), np.float32)})


NONNEGATIVE = ModelSpec((TensorSpec("x", np.float32, [4]),), (TensorSpec("y", np.float32, [4]),), 8)


def refuse_negatives(d):
    """A user's own check: a plain ValueError on any negative value (random samples have
    some)."""
    if (d["x"] < 0).any():
        raise ValueError("negative feature at row 0 col 1")
    return {"y": d["x"] * 2}


def test_a_warm_up_that_raises_anything_is_said_once_and_the_model_still_serves(caplog):
    from servekit.runners.base import warm_up

    runner = FunctionRunner(refuse_negatives, NONNEGATIVE)
    with caplog.at_level("WARNING", logger="servekit.runners.base"):
        failed = warm_up(runner, "scorer")
    assert isinstance(failed, RunnerError) and "negative feature" in str(failed)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("scorer: warm-up skipped")
    assert "ValueError: negative feature at row 0 col 1" in lines[0]
    assert "warmup_inputs(rows)" in lines[0] and "warmup()" in lines[0]
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(runner.infer({"x": x})["y"], x * 2)


def test_a_models_own_warm_up_that_raises_does_not_stop_it_either(caplog):
    import servekit
    from servekit.custom import UserRunner
    from servekit.runners.base import warm_up

    class Scorer(servekit.Model):
        inputs = [("x", "FP32", [4])]
        outputs = [("y", "FP32", [4])]
        max_batch_size = 8

        def warmup(self):
            raise KeyError("weights.bin")

        def infer(self, batch):
            return {"y": batch["x"] + 1}

    runner = UserRunner(Scorer(), "scorer")
    with caplog.at_level("WARNING", logger="servekit.runners.base"):
        assert isinstance(warm_up(runner, "scorer"), KeyError)
    assert [r.getMessage().count("warm-up skipped") for r in caplog.records] == [1]
    assert "KeyError: 'weights.bin'" in caplog.records[0].getMessage()
    assert runner.infer({"x": np.zeros((1, 4), np.float32)})["y"].tolist() == [[1.0] * 4]
