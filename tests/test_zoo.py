"""Reference models: ResNet-50's architecture, determinism and numerical health."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from servekit import ModelNotFound, OnnxRuntimeRunner, zoo
from servekit.stages import Preprocess, synthetic_image
from servekit.zoo.resnet import STAGES, build_resnet50

BN_CHANNELS = 64 + sum(blocks * (w + w + 4 * w) + 4 * w for w, blocks, _ in STAGES)


def test_resnet50_build_is_deterministic(resnet50_path):
    again = build_resnet50().SerializeToString()
    assert (
        hashlib.sha256(again).hexdigest() == hashlib.sha256(resnet50_path.read_bytes()).hexdigest()
    )


def test_resnet50_has_resnet50s_parameters_with_batchnorm_folded(resnet50_path):
    model = onnx.load(resnet50_path)
    ops = Counter(n.op_type for n in model.graph.node)
    assert "BatchNormalization" not in ops
    assert ops["Conv"] == 53  # 1 stem + 16 blocks x 3 + 4 projection shortcuts
    assert ops["Add"] == 16
    # Folding replaces BN's gamma and beta (2 per channel) by one conv bias per channel.
    assert zoo.param_count(model) == zoo.RESNET50_PARAMS_WITH_BN - BN_CHANNELS == 25_530_472


def test_resnet50_is_v1_5_with_stride_on_the_3x3_conv(resnet50_path):
    nodes = {n.name: n for n in onnx.load(resnet50_path).graph.node}
    strides = {a.name: list(a.ints) for a in nodes["layer2.0.conv2"].attribute}["strides"]
    assert strides == [2, 2]
    assert {a.name: list(a.ints) for a in nodes["layer2.0.conv1"].attribute}["strides"] == [1, 1]


@pytest.fixture(scope="module")
def resnet(resnet50_path):
    with OnnxRuntimeRunner(resnet50_path) as runner:
        yield runner


def test_resnet50_signature(resnet):
    assert resnet.spec.inputs[0].shape == (3, 224, 224)
    assert resnet.spec.outputs[0].shape == (1000,)


def test_resnet50_logits_are_finite_and_differ_between_images(resnet):
    images = [synthetic_image(seed) for seed in range(8)]
    x = Preprocess(workers=1).images(images)
    logits = resnet.infer({"input": x})["logits"]
    assert logits.shape == (8, 1000)
    assert np.isfinite(logits).all()
    assert np.abs(logits).max() < 1e3
    assert len(set(logits.argmax(axis=1).tolist())) >= 4
    corr = np.corrcoef(logits)[np.triu_indices(8, 1)]
    assert corr.max() < 0.95


def test_resnet50_on_onnxruntime_matches_the_reference_evaluator(resnet, resnet50_path):
    x = Preprocess(workers=1).images([synthetic_image(3)])
    expected = ReferenceEvaluator(onnx.load(resnet50_path)).run(None, {"input": x})[0]
    got = resnet.infer({"input": x})["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)


def test_unknown_zoo_models_are_named(tmp_path):
    with pytest.raises(ModelNotFound, match="'resnet51'.*resnet50"):
        zoo.build("resnet51", tmp_path)


def test_build_uses_the_cache_unless_forced(tmp_path):
    path = zoo.build("add_sub", tmp_path)
    path.write_bytes(b"stale")
    assert zoo.build("add_sub", tmp_path).read_bytes() == b"stale"
    assert zoo.build("add_sub", tmp_path, force=True).read_bytes() != b"stale"


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVEKIT_CACHE", str(tmp_path))
    assert zoo.cache_dir() == tmp_path


def test_resolve_takes_a_zoo_name_or_an_existing_file_and_names_anything_else(
    model_cache, tmp_path
):
    built = zoo.resolve("tiny_cnn", model_cache)
    assert built == zoo.build("tiny_cnn", model_cache) and built.is_file()
    assert zoo.resolve(built) == built
    with pytest.raises(ModelNotFound, match=r"no zoo model or model file '.*missing.onnx'"):
        zoo.resolve(tmp_path / "missing.onnx")
