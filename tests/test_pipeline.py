"""The in-process Pipeline: equal to running its steps by hand; wiring checked up front."""

from __future__ import annotations

import numpy as np
import pytest

from servekit import (
    FunctionRunner,
    InvalidInput,
    ModelSpec,
    OnnxRuntimeRunner,
    Pipeline,
    Postprocess,
    Preprocess,
    TensorSpec,
    image_classifier,
)
from servekit.stages import synthetic_image


def blobs(images):
    arr = np.empty((len(images), 1), dtype=object)
    arr[:, 0] = images
    return arr


def test_pipeline_equals_its_steps_run_by_hand(tiny_cnn_path):
    pre, model, post = (
        Preprocess(crop=32, resize=36, workers=1),
        OnnxRuntimeRunner(tiny_cnn_path),
        Postprocess(num_classes=10, top_k=3),
    )
    pipe = Pipeline([pre, model, post])
    x = blobs([synthetic_image(i) for i in range(4)])
    got = pipe.infer({"image": x})
    by_hand = post.infer(model.infer(pre.infer({"image": x})))
    assert got.keys() == by_hand.keys() == {"scores", "classes", "labels"}
    for k in got:
        np.testing.assert_array_equal(got[k], by_hand[k])
    assert pipe.spec.inputs == pre.spec.inputs
    assert pipe.spec.outputs == post.spec.outputs


def test_mismatched_steps_are_rejected_when_the_pipeline_is_built(tiny_cnn_path):
    with pytest.raises(
        ValueError, match=r"input 'input' expects FP32 \[3, 32, 32\].*FP32 \[3, 224, 224\]"
    ):
        Pipeline([Preprocess(), OnnxRuntimeRunner(tiny_cnn_path)])


def test_later_steps_can_take_request_inputs_directly():
    spec_a = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("h", np.float32, [2]),), 4)
    spec_b = ModelSpec(
        (TensorSpec("h", np.float32, [2]), TensorSpec("bias", np.float32, [2])),
        (TensorSpec("y", np.float32, [2]),),
        4,
    )
    pipe = Pipeline(
        [
            FunctionRunner(lambda d: {"h": d["x"] * 2}, spec_a),
            FunctionRunner(lambda d: {"y": d["h"] + d["bias"]}, spec_b),
        ]
    )
    assert [t.name for t in pipe.spec.inputs] == ["x", "bias"]
    x, b = np.ones((2, 2), np.float32), np.full((2, 2), 3, np.float32)
    np.testing.assert_array_equal(pipe.infer({"x": x, "bias": b})["y"], x * 2 + b)


def test_resnet50_classifier_returns_sorted_top5(resnet50_path):
    clf = image_classifier(resnet50_path)
    preds = clf.classify([synthetic_image(0), synthetic_image(1, fmt="PNG")])
    assert [len(p) for p in preds] == [5, 5]
    for p in preds:
        scores = [x.score for x in p]
        assert scores == sorted(scores, reverse=True)
        assert all(0 < s < 1 for s in scores)
        assert p[0].label == f"class_{p[0].class_id}"
    assert preds[0][0].class_id != preds[1][0].class_id


def test_classify_splits_more_images_than_max_batch_size(tiny_cnn_path):
    clf = image_classifier(tiny_cnn_path, max_batch_size=4, top_k=2)
    images = [synthetic_image(i) for i in range(10)]
    assert clf.classify(images) == [clf.classify([img])[0] for img in images]


def test_one_bad_image_is_reported_by_row(tiny_cnn_path):
    clf = image_classifier(tiny_cnn_path)
    with pytest.raises(InvalidInput, match="row 1"):
        clf.classify([synthetic_image(0), b"garbage"])


def test_classifier_needs_an_image_model(add_sub_path):
    with pytest.raises(ValueError, match="one input and one output"):
        image_classifier(add_sub_path)


def test_classifier_can_wrap_an_existing_runner(tiny_cnn_path):
    runner = OnnxRuntimeRunner(tiny_cnn_path)
    clf = image_classifier(runner, top_k=2)
    assert clf.steps[1] is runner
    assert clf.classify([synthetic_image(0)]) == image_classifier(tiny_cnn_path, top_k=2).classify(
        [synthetic_image(0)]
    )
