"""A classifier with its preprocessing folded in (``fold_pixels``, ``servekit optimize
--pixels``): it takes the decoded, cropped image as UINT8 NHWC pixels, a quarter of FP32's
bytes, and answers as the host's Preprocess plus the model do; served by every runtime,
where a client that sends floats gets an error naming the tensor while seven others are
answered."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from conftest import each_client, serve_on_runtime
from servekit import ModelConfig
from servekit.cli import app
from servekit.optimize import PIXELS, fold_pixels
from servekit.pipeline import image_stages
from servekit.runners.onnx import OnnxRuntimeRunner
from servekit.stages import decode_image, synthetic_image


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_folded_resnet50_answers_the_host_preprocessing_to_the_bit(resnet50_path, tmp_path):
    from servekit.accuracy import photo_set

    pytest.importorskip("skimage", reason="the photos need scikit-image (the dev extra)")
    images = photo_set(variants=False)[:6] + [synthetic_image(i, (500, 375)) for i in range(2)]
    runner = OnnxRuntimeRunner(resnet50_path)
    pre, _ = image_stages(runner.spec, runner.metadata)
    floats = pre.images(images)
    folded = fold_pixels(resnet50_path, output=tmp_path / "resnet50.pixels.onnx")
    pixels = np.stack([decode_image(b) for b in images])
    assert pixels.dtype == np.uint8 and pixels.shape == (len(images), 224, 224, 3)
    want = session(resnet50_path).run(None, {"input": floats})[0]
    got = session(folded).run(None, {PIXELS: pixels})[0]
    assert np.array_equal(got, want)  # the same float operations, in the same order
    assert (np.argsort(-got, 1)[:, :5] == np.argsort(-want, 1)[:, :5]).all()
    assert floats.nbytes == 4 * pixels.nbytes


def test_the_scaling_comes_from_the_models_metadata(tmp_path):
    import json

    import onnx

    from servekit.zoo.tiny import build_tiny_cnn

    model = build_tiny_cnn()
    mean, std = (0.5, 0.25, 0.125), (0.2, 0.3, 0.4)
    onnx.helper.set_model_props(
        model, {"servekit.mean": json.dumps(mean), "servekit.std": json.dumps(std)}
    )
    src = tmp_path / "scaled.onnx"
    onnx.save(model, src)
    folded = fold_pixels(src)
    assert folded == tmp_path / "scaled.pixels.onnx"
    pixels = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    by_hand = (pixels / 255.0 - np.asarray(mean)) / np.asarray(std)
    x = by_hand.transpose(0, 3, 1, 2).astype(np.float32)
    want = session(src).run(None, {"input": x})[0]
    got = session(folded).run(None, {PIXELS: pixels})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    props = {p.key: p.value for p in onnx.load(str(folded)).metadata_props}
    assert props["servekit.mean"] == json.dumps(mean)  # kept, and the input said
    assert props["servekit.pixels"] == "uint8 NHWC RGB"


def test_a_model_that_is_no_image_classifier_is_refused_naming_its_input(
    add_sub_path, tiny_cnn_path, tmp_path
):
    with pytest.raises(ValueError, match=r"has 2 inputs; an image classifier has 1"):
        fold_pixels(add_sub_path, output=tmp_path / "x.onnx")
    folded = fold_pixels(tiny_cnn_path, output=tmp_path / "tiny.pixels.onnx")
    with pytest.raises(
        ValueError,
        match=r"input 'pixels' of .*: expected FLOAT \[N,3,S,S\], got UINT8 \['batch', 32, 32, 3\]",
    ):
        fold_pixels(folded, output=tmp_path / "twice.onnx")


def test_optimize_pixels_writes_a_model_that_takes_pixels(tiny_cnn_path, tmp_path):
    out = tmp_path / "tiny.pixels.onnx"
    result = CliRunner().invoke(
        app,
        ["optimize", str(tiny_cnn_path), "--precision", "fp32", "--pixels", "--output", str(out)],
    )
    assert result.exit_code == 0, result.output
    (x,) = session(out).get_inputs()
    assert (x.name, x.type, x.shape[1:]) == (PIXELS, "tensor(uint8)", [32, 32, 3])


@pytest.fixture(params=["native", "pytriton", "triton", "ray"])
def serving(request):
    return serve_on_runtime(request, request.param)


def test_every_runtime_serves_pixels_and_a_client_sending_floats_fails_alone(
    serving, tiny_cnn_path, tmp_path
):
    pytest.importorskip("tritonclient", reason="needs the triton extra")
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    folded = fold_pixels(tiny_cnn_path, output=tmp_path / "tiny.pixels.onnx")
    reference = session(folded)
    with serving(ModelConfig(str(folded), "tiny")) as served:
        wrong: list[str] = []
        refusals: list[str] = []

        def client(k: int) -> None:
            module = grpcclient if k % 2 and served.grpc_port else httpclient
            port = served.grpc_port if module is grpcclient else served.http_port
            c = module.InferenceServerClient(f"127.0.0.1:{port}")
            rng = np.random.default_rng(k)
            try:
                for i in range(6):
                    pixels = rng.integers(0, 256, (1 + i % 3, 32, 32, 3), dtype=np.uint8)
                    kind = "FP32" if k == 0 else "UINT8"
                    x = module.InferInput(PIXELS, list(pixels.shape), kind)
                    x.set_data_from_numpy(pixels.astype(np.float32) if k == 0 else pixels)
                    try:
                        got = c.infer("tiny", [x]).as_numpy("logits")
                    except InferenceServerException as exc:
                        (refusals if k == 0 else wrong).append(exc.message())
                        continue
                    if k == 0:
                        wrong.append("floats were answered")
                    elif not np.allclose(got, reference.run(None, {PIXELS: pixels})[0], atol=1e-5):
                        wrong.append(f"client {k} request {i}: wrong logits")
            finally:
                c.close()

        each_client(client, timeout_s=180)
        assert not wrong, wrong[:3]
        assert len(refusals) == 6
        for said in refusals:
            assert PIXELS in said and "UINT8" in said and "FP32" in said, said
        assert served.pending("tiny") == 0  # idle again once the clients stop
