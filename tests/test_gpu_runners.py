"""TensorRT and Torch runners: everything that needs no GPU here, the rest where one is.

Engine cache keys, the optimisation profile, CUDA-graph batch sizes, the ONNX-to-torch
translation (when PyTorch is installed) and the runtime switch run on this machine; the
TensorRT and CUDA executions skip with the reason when TensorRT or a GPU is missing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import has_cuda, needs_cuda, needs_torch
from servekit import OnnxRuntimeRunner, zoo
from servekit.device import DeviceTensor
from servekit.optimize import optimize
from servekit.runners import ENGINES, load_runner
from servekit.runners.onnx import spec_from_onnx
from servekit.runners.tensorrt import (
    EngineKey,
    TensorRTRunner,
    device_source,
    engine_cache_dir,
    is_explicitly_quantized,
    optimization_profile,
)
from servekit.runners.torch import graph_batch_sizes, onnx_module
from servekit.spec import ModelSpec, TensorSpec
from servekit.triton.backend import _switch, build_runner

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
needs_trt = pytest.mark.skipif(
    not (HAS_TRT and has_cuda()),
    reason="TensorRT and an NVIDIA GPU are needed (servekit[tensorrt])",
)

IMAGE = ModelSpec(
    (TensorSpec("input", np.float32, [3, 224, 224]),),
    (TensorSpec("logits", np.float32, [1000]),),
    max_batch_size=32,
)


# --- the TensorRT optimisation profile and engine cache ---


@given(
    most=st.integers(1, 256),
    preferred=st.lists(st.integers(1, 300), max_size=4),
)
def test_the_profile_spans_every_batch_the_policy_can_form(most, preferred):
    ((name, lo, opt, hi),) = optimization_profile(IMAGE, most, preferred)
    assert name == "input"
    assert lo == (1, 3, 224, 224) and hi == (most, 3, 224, 224)
    fitting = [b for b in preferred if b <= most]
    assert opt[0] == (max(fitting) if fitting else most)
    assert lo[0] <= opt[0] <= hi[0] and opt[1:] == lo[1:]


def test_the_profile_takes_the_specs_max_batch_size_by_default():
    assert optimization_profile(IMAGE)[0][3] == (32, 3, 224, 224)


def test_a_variable_non_batch_dim_is_refused_naming_the_tensor():
    spec = ModelSpec(
        (TensorSpec("tokens", np.int64, [-1]),), (TensorSpec("y", np.float32, [2]),), 8
    )
    with pytest.raises(ValueError, match=r"'tokens' has a variable dim \[-1\]"):
        optimization_profile(spec)


def test_an_unbatched_model_gets_its_fixed_shapes():
    spec = ModelSpec((TensorSpec("x", np.float32, [4, 4]),), (TensorSpec("y", np.float32, [4]),), 0)
    assert optimization_profile(spec, 16, (8,)) == (("x", (4, 4), (4, 4), (4, 4)),)


KEY = EngineKey(
    model_sha256="ab" * 32,
    precision="fp16",
    gpu="Tesla T4",
    compute_capability=(7, 5),
    tensorrt_version="10.3.0",
    profile=optimization_profile(IMAGE, 16, (8,)),
)


@pytest.mark.parametrize(
    "change",
    [
        {"model_sha256": "cd" * 32},
        {"precision": "int8"},
        {"gpu": "NVIDIA H100 80GB HBM3"},
        {"compute_capability": (9, 0)},
        {"tensorrt_version": "10.4.0"},
        {"profile": optimization_profile(IMAGE, 32, (8,))},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_field_of_the_engine_key_changes_the_engine_file(change):
    other = dataclasses.replace(KEY, **change)
    assert other.engine_file("resnet50") != KEY.engine_file("resnet50")
    assert dataclasses.replace(KEY).engine_file("resnet50") == KEY.engine_file("resnet50")


def test_engine_file_names_say_what_they_hold_and_are_safe():
    name = KEY.engine_file("../my model")
    assert name.startswith("___my_model.fp16.sm75.trt10_3_0.") and name.endswith(".engine")
    assert "/" not in name


def test_the_timing_cache_is_shared_across_models_and_precisions_on_one_gpu():
    other = dataclasses.replace(KEY, model_sha256="cd" * 32, precision="int8")
    assert (
        other.timing_cache_file()
        == KEY.timing_cache_file()
        == "timing.Tesla_T4.sm75.trt10_3_0.cache"
    )
    assert dataclasses.replace(KEY, gpu="NVIDIA A10").timing_cache_file() != KEY.timing_cache_file()


def test_engine_cache_dir_follows_servekit_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVEKIT_CACHE", str(tmp_path))
    assert engine_cache_dir() == tmp_path / "engines"
    assert engine_cache_dir(tmp_path / "x") == tmp_path / "x"


def test_qdq_models_are_recognised_as_explicitly_quantised(tiny_cnn_path, tmp_path):
    assert not is_explicitly_quantized(tiny_cnn_path)
    qdq = optimize(tiny_cnn_path, "int8", output=tmp_path / "t.int8.onnx", target="tensorrt")
    assert is_explicitly_quantized(qdq)


def test_int8_on_tensorrt_without_qdq_says_how_to_make_it(tiny_cnn_path):
    with pytest.raises(ValueError, match="--precision int8 --target tensorrt"):
        TensorRTRunner(tiny_cnn_path, precision="int8")


def test_an_unknown_tensorrt_precision_is_refused(tiny_cnn_path):
    with pytest.raises(ValueError, match="precision must be one of"):
        TensorRTRunner(tiny_cnn_path, precision="fp8")


def test_the_backend_reads_overlap_as_auto_true_or_false_and_names_anything_else():
    assert [_switch({"overlap": v}, "overlap") for v in ("auto", "", "true", "false")] == [
        None, None, True, False,
    ]  # fmt: skip
    assert _switch({}, "overlap") is None
    with pytest.raises(
        ValueError, match=re.escape("parameter overlap: expected auto, true or false, got 'yes'")
    ):
        _switch({"overlap": "yes"}, "overlap")


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here")
def test_without_tensorrt_the_runner_says_what_to_install(tiny_cnn_path):
    with pytest.raises(ImportError, match=r"servekit\[tensorrt\]"):
        TensorRTRunner(tiny_cnn_path, precision="fp16")


# --- the spec both engines read from the ONNX file ---


@pytest.mark.parametrize("name", ["tiny_cnn", "add_sub", "resnet50"])
def test_spec_from_onnx_matches_onnx_runtimes(name, model_cache):
    path = zoo.build(name, model_cache)
    assert spec_from_onnx(path) == OnnxRuntimeRunner(path).spec
    assert spec_from_onnx(path, 8) == OnnxRuntimeRunner(path, max_batch_size=8).spec
    assert spec_from_onnx(path, 0) == OnnxRuntimeRunner(path, max_batch_size=0).spec


# --- one switch for every runtime ---


def test_load_runner_gives_onnx_runtime_by_default(tiny_cnn_path):
    runner = load_runner(tiny_cnn_path, max_batch_size=4)
    assert isinstance(runner, OnnxRuntimeRunner) and runner.spec.max_batch_size == 4


def test_onnx_runtime_runs_the_file_as_written(tiny_cnn_path):
    with pytest.raises(ValueError, match="make an int8 file with `servekit optimize`"):
        load_runner(tiny_cnn_path, precision="int8")


def test_an_unknown_engine_is_refused(tiny_cnn_path):
    with pytest.raises(
        ValueError, match=r"engine must be one of \('onnxruntime', 'tensorrt', 'torch'\)"
    ):
        load_runner(tiny_cnn_path, engine="openvino")
    assert ENGINES == ("onnxruntime", "tensorrt", "torch")


def _version_dir(tmp_path: Path, model: Path) -> Path:
    version = tmp_path / "1"
    version.mkdir()
    (version / "model.onnx").write_bytes(model.read_bytes())
    return version


def test_the_backend_names_a_runner_it_does_not_know(tmp_path, tiny_cnn_path):
    with pytest.raises(ValueError, match="parameter runner must be one of"):
        build_runner({"runner": "openvino"}, _version_dir(tmp_path, tiny_cnn_path), 8)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"threads": "two"}, "parameter threads: expected an integer, got 'two'"),
        (
            {"preferred_batch_sizes": "4,eight"},
            "parameter preferred_batch_sizes: expected an integer, got 'eight'",
        ),
        (
            {"kind": "preprocess", "crop": "224px"},
            "parameter crop: expected an integer, got '224px'",
        ),
        (
            {"kind": "postprocess", "top_k": "5.0"},
            "parameter top_k: expected an integer, got '5.0'",
        ),
    ],
)
def test_the_backend_names_a_parameter_that_is_not_an_integer(
    tmp_path, tiny_cnn_path, params, named
):
    with pytest.raises(ValueError, match=re.escape(named)):
        build_runner(params, _version_dir(tmp_path, tiny_cnn_path), 8)


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here")
def test_the_backend_reports_a_tensorrt_model_it_cannot_load(tmp_path, tiny_cnn_path):
    params = {"runner": "tensorrt", "precision": "fp16"}
    with pytest.raises(
        ValueError, match=r"cannot load model.onnx: ImportError: .*servekit\[tensorrt\]"
    ):
        build_runner(params, _version_dir(tmp_path, tiny_cnn_path), 8)


# --- Torch: CUDA graph sizes and the ONNX translation ---


@given(most=st.integers(1, 512), preferred=st.lists(st.integers(1, 600), max_size=4))
def test_every_batch_fits_a_captured_graph(most, preferred):
    sizes = graph_batch_sizes(most, preferred)
    assert sizes[0] == 1 and sizes[-1] == most and list(sizes) == sorted(set(sizes))
    assert {b for b in preferred if b <= most} <= set(sizes)
    assert len(sizes) <= most.bit_length() + len(preferred) + 1


def test_an_operator_torch_cannot_run_is_named(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4])
    node = onnx.helper.make_node("Erf", ["x"], ["y"], name="erf0")
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y]))
    path = tmp_path / "erf.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ValueError, match=r"operator Erf \(erf0\) is not supported"):
        onnx_module(path)


@needs_torch
@pytest.mark.parametrize("name", ["tiny_cnn", "resnet50", "efficientnet_lite0"])
def test_the_torch_translation_matches_onnx_runtime(name, model_cache):
    from servekit.runners.torch import TorchRunner

    path = zoo.build(name, model_cache)
    reference = OnnxRuntimeRunner(path)
    x = reference.spec.sample_inputs(3)
    want = reference.infer(x)["logits"]
    got = TorchRunner(path, device="cpu", precision="fp32").infer(x)["logits"]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    bf16 = TorchRunner(path, device="cpu", precision="bf16").infer(x)["logits"]
    assert bf16.dtype == np.float32
    assert np.abs(bf16 - want).max() <= 0.05 * np.abs(want).max()


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=needs_torch), pytest.param("cuda", marks=needs_cuda)]
)
def test_a_users_module_with_one_output_returns_a_tensor_and_is_served_as_it_is(device):
    """A plain ``nn.Module`` returns its one output as a tensor, not a tuple of one: each
    row of the batch is its own answer (a CUDA graph's replay too)."""
    import torch

    from servekit.runners.torch import TorchRunner

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    spec = ModelSpec(
        (TensorSpec("x", np.float32, [4]),), (TensorSpec("y", np.float32, [3]),), max_batch_size=8
    )
    xs = [np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32) for n in (1, 3, 8)]
    with torch.inference_mode():
        wants = [module(torch.from_numpy(x)).numpy() for x in xs]  # before it moves to the device
    runner = TorchRunner(module, spec=spec, device=device, precision="fp32", channels_last=False)
    for x, want in zip(xs, wants, strict=True):
        np.testing.assert_allclose(runner.infer({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    runner.close()


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=needs_torch), pytest.param("cuda", marks=needs_cuda)]
)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_torch_runs_a_model_that_takes_pixels_like_onnx_runtime(
    device, precision, tiny_cnn_path, tmp_path
):
    from servekit.optimize import PIXELS, fold_pixels
    from servekit.runners.torch import TorchRunner

    if device == "cpu" and precision == "fp16":
        pytest.skip("fp16 convolutions are a GPU's")
    folded = fold_pixels(tiny_cnn_path, output=tmp_path / "tiny.pixels.onnx")
    reference = OnnxRuntimeRunner(folded)
    runner = TorchRunner(folded, device=device, precision=precision, max_batch_size=8)
    assert runner.spec.inputs[0].dtype.datatype == "UINT8"
    pixels = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    want = reference.infer({PIXELS: pixels})["logits"]
    got = runner.infer({PIXELS: pixels})["logits"]
    tolerance = {"fp32": 1e-4, "fp16": 1e-2}[precision]
    assert np.abs(got - want).max() <= tolerance * max(np.abs(want).max(), 1.0)


@needs_torch
@pytest.mark.skipif(has_cuda(), reason="a GPU is present")
def test_asking_torch_for_cuda_without_a_gpu_says_so(tiny_cnn_path):
    from servekit.runners.torch import TorchRunner

    with pytest.raises(RuntimeError, match="CUDA is unavailable"):
        TorchRunner(tiny_cnn_path, device="cuda")


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_cuda_graphs_answer_every_batch_size_like_onnx_runtime(precision, tiny_cnn_path):
    from servekit.runners.torch import TorchRunner

    reference = OnnxRuntimeRunner(tiny_cnn_path)
    runner = TorchRunner(tiny_cnn_path, precision=precision, max_batch_size=16)
    assert runner.graph_sizes == (1, 2, 4, 8, 16)
    tolerance = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}[precision]
    for rows in (1, 3, 8, 13, 16):
        x = reference.spec.sample_inputs(rows, np.random.default_rng(rows))
        want = reference.infer(x)["logits"]
        got = runner.infer(x)["logits"]
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= tolerance * max(np.abs(want).max(), 1.0)


@needs_cuda
def test_two_lanes_interleaving_under_eight_clients_answer_like_onnx_runtime(tiny_cnn_path):
    """Two instances on one GPU, each on its own lane (stream, graphs, buffers), fed from
    the runner's pinned staging by eight threads: every caller gets its own rows' answer."""
    from conftest import each_client
    from servekit import Batcher, BatchingPolicy
    from servekit.runners.torch import TorchRunner

    reference = OnnxRuntimeRunner(tiny_cnn_path)
    runner = TorchRunner(tiny_cnn_path, precision="fp32", max_batch_size=16, instances=2)
    assert runner.staging.pinned and len(runner._lanes or ()) == 2
    batcher = Batcher(runner, BatchingPolicy(max_queue_delay_us=300), instance_count=2, name="t")
    wrong: list[str] = []

    def client(c: int) -> None:
        rng = np.random.default_rng(c)
        for k in range(60):
            x = reference.spec.sample_inputs(1 + k % 3, rng)
            want = reference.infer(x)["logits"]
            got = batcher.infer_sync(x, wait_s=30)["logits"]
            if got.shape != want.shape or np.abs(got - want).max() > 1e-4 * max(
                np.abs(want).max(), 1.0
            ):
                wrong.append(f"client {c} request {k}")

    each_client(client)
    batcher.close()
    runner.close()
    assert not wrong, wrong[:5]
    assert batcher.stats.execution_count < 480  # batches formed


@needs_trt
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_matches_onnx_runtime_and_reuses_its_engine(precision, tiny_cnn_path, tmp_path):
    reference = OnnxRuntimeRunner(tiny_cnn_path)
    runner = TensorRTRunner(
        tiny_cnn_path, precision=precision, max_batch_size=8, cache_dir=tmp_path
    )
    for rows in (1, 5, 8):
        x = reference.spec.sample_inputs(rows, np.random.default_rng(rows))
        want = reference.infer(x)["logits"]
        got = runner.infer(x)["logits"]
        assert np.abs(got - want).max() <= 1e-2 * max(np.abs(want).max(), 1.0)
        if runner.tensor_device is not None:  # torch is here: the same rows from the GPU
            import torch

            on_gpu = {
                k: DeviceTensor(torch.from_numpy(v).to("cuda"), v.dtype) for k, v in x.items()
            }
            assert np.array_equal(runner.infer(on_gpu)["logits"], got)
    runner.close()
    built = runner.engine_path.stat().st_mtime_ns
    again = TensorRTRunner(tiny_cnn_path, precision=precision, max_batch_size=8, cache_dir=tmp_path)
    assert again.engine_path == runner.engine_path
    assert again.engine_path.stat().st_mtime_ns == built
    again.close()


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=needs_torch), pytest.param("cuda", marks=needs_cuda)]
)
def test_only_a_tensor_on_a_gpu_is_handed_to_tensorrt_as_it_is_cast_and_contiguous(device):
    """What the TensorRT runner copies device to device: a ``DeviceTensor``'s or a stage's
    torch tensor on a GPU, in the engine's dtype, contiguous, on its own device. Rows on
    the host (an array, a CPU tensor) are not (they go through pinned memory)."""
    import torch

    rows = torch.arange(24, dtype=torch.float64, device=device).reshape(2, 3, 4)
    streams = {}

    def lane_stream(d):  # a lane's stream, as torch takes it
        return streams.setdefault(str(d), torch.cuda.Stream(d))

    got = device_source(
        DeviceTensor(rows.transpose(1, 2), np.dtype(np.float64)), np.dtype(np.float32),
        lane_stream,
    )  # fmt: skip
    assert device_source(rows.cpu().numpy(), np.dtype(np.float32), lane_stream) is None
    if device == "cpu":
        assert got is None and device_source(rows, np.dtype(np.float32), lane_stream) is None
        return
    streams[str(rows.device)].synchronize()
    assert got.dtype == torch.float32 and got.is_contiguous() and got.device == rows.device
    assert torch.equal(got, rows.transpose(1, 2).float())
    assert device_source(rows, np.dtype(np.float16), lane_stream).dtype == torch.float16
