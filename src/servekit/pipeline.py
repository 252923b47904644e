"""In-process composition of stages and runners: the no-server baseline.

``Pipeline([Preprocess(), OnnxRuntimeRunner(path), Postprocess()])`` wires each
step's inputs to earlier outputs by tensor name, like a Triton ensemble's
``input_map``/``output_map`` with identical names.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import tracing, zoo
from .runners.base import Arrays, BaseRunner, Lender, Runner, accelerated, batch_function
from .runners.onnx import OnnxRuntimeRunner
from .spec import ModelSpec, TensorSpec
from .stages import Postprocess, Preprocess, input_scaling

__all__ = [
    "ImageClassifier",
    "Pipeline",
    "Prediction",
    "image_classifier",
    "image_stages",
    "is_image_classifier",
]


def _compatible(produced: TensorSpec, consumed: TensorSpec) -> bool:
    return (
        produced.dtype == consumed.dtype
        and len(produced.shape) == len(consumed.shape)
        and all(
            a == -1 or b == -1 or a == b
            for a, b in zip(produced.shape, consumed.shape, strict=True)
        )
    )


class Pipeline(BaseRunner):
    """Runs steps in order; a step's inputs are the request's or an earlier step's outputs.

    Raises:
        ValueError: at construction, when a step consumes a tensor that an earlier step
            produces with another dtype or shape, or when batching differs between steps.
    """

    def __init__(self, steps: Sequence[Runner], names: Sequence[str] = ()) -> None:
        if not steps:
            raise ValueError("a Pipeline needs at least one step")
        batched = {s.spec.batched for s in steps}
        if len(batched) != 1:
            raise ValueError("all pipeline steps must batch (max_batch_size > 0) or none may")
        produced: dict[str, TensorSpec] = {}
        inputs: list[TensorSpec] = []
        for i, step in enumerate(steps):
            for t in step.spec.inputs:
                if t.name not in produced:
                    if all(t.name != x.name for x in inputs):
                        inputs.append(t)
                elif not _compatible(produced[t.name], t):
                    p = produced[t.name]
                    raise ValueError(
                        f"step {i} ({type(step).__name__}) input {t.name!r} expects "
                        f"{t.dtype} {list(t.shape)}, but an earlier step produces {p.dtype} "
                        f"{list(p.shape)}"
                    )
            produced.update({t.name: t for t in step.spec.outputs})
        self.steps = tuple(steps)
        self.accelerated = any(accelerated(s) for s in self.steps)
        self.step_names = tuple(names) or tuple(type(s).__name__ for s in steps)
        """Each step's name in a traced batch's spans (``step <name>``)."""
        self._spec = ModelSpec(
            tuple(inputs),
            steps[-1].spec.outputs,
            min(s.spec.max_batch_size for s in steps),
        )
        self.check_outputs = False  # the last step already checked them

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        tensors = dict(inputs)
        traced = tracing.BATCH.get()  # a traced request's batch: each step's time is a span
        for name, step in zip(self.step_names, self.steps, strict=True):
            start = time.monotonic()
            tensors.update(_infer(step, {t.name: tensors[t.name] for t in step.spec.inputs}))
            if traced is not None:
                traced.steps.append((name, start, time.monotonic()))
        return {t.name: tensors[t.name] for t in self._spec.outputs}

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        for step in self.steps:
            step.warmup()

    def close(self) -> None:
        for step in self.steps:
            step.close()


def _infer(step: Runner, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """``step``'s outputs; a step that lends pinned staging (a model on a GPU) gets its
    inputs there, as a batch gathered by a Batcher does, so its copy to the device is one
    asynchronous DMA."""
    if not isinstance(step, Lender) or not step.staging.pinned:
        return step.infer(inputs)
    names = [t.name for t in step.spec.inputs]
    with step.staging.lend() as staging:
        return staging.detach(step.infer(staging.gather([inputs], names)))


@dataclass(frozen=True, slots=True)
class Prediction:
    """One of an image's top-k classes."""

    label: str
    class_id: int
    score: float


class ImageClassifier(Pipeline):
    """Encoded images -> top-k predictions: Preprocess -> model -> Postprocess.

    Where the model takes tensors on a GPU as they are (``TorchRunner.tensor_device``) and
    torchvision is installed, the images are decoded, resized, cropped and scaled on that
    GPU and handed to the model there (``stages.DeviceDecode``); elsewhere by Preprocess
    on the host. ``decode_on`` names the torch device to decode on whatever the model
    (``"cpu"``: torchvision's CPU decoders, the same path, where no GPU is), or ``"host"``
    for Preprocess always."""

    def __init__(
        self, steps: Sequence[Runner], names: Sequence[str] = (), *, decode_on: str | None = None
    ) -> None:
        super().__init__(steps, names)
        self.decode_on = decode_on
        self._decoders: dict[str, Any] = {}

    def _decoder(self) -> Any:
        """The DeviceDecode for the model's device now (a reload may change it), or None."""
        from .stages.device_image import DeviceDecode, device_decode_available

        if self.decode_on == "host" or len(self.steps) != 3:
            return None
        pre, model, _ = self.steps
        if not isinstance(pre, Preprocess):
            return None
        serving = getattr(model, "runner", model)  # a VersionedRunner's serving version
        device = self.decode_on
        if device is None:  # auto: on the model's GPU, if it takes tensors there
            own = getattr(serving, "tensor_device", None)
            device = own if own is not None and own.type == "cuda" else None
        if device is None or not device_decode_available():
            return None
        key = str(device)
        if key not in self._decoders:
            self._decoders[key] = DeviceDecode(pre, device)
        return self._decoders[key]

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        decode = self._decoder()
        if decode is None:
            return super()._run(inputs)
        pre, model, post = self.steps
        assert isinstance(pre, Preprocess)  # _decoder checked it
        traced = tracing.BATCH.get()
        marks = [time.monotonic()]
        x: Any = decode.batch(inputs[pre.input_name])
        if getattr(getattr(model, "runner", model), "tensor_device", None) != decode.device:
            x = np.asarray(x)  # a model that takes host arrays (decode_on names a device)
        marks.append(time.monotonic())
        logits = batch_function(model)({pre.output_name: x})
        marks.append(time.monotonic())
        out = post.infer({t.name: logits[t.name] for t in post.spec.inputs})
        marks.append(time.monotonic())
        if traced is not None:
            for name, start, end in zip(self.step_names, marks, marks[1:], strict=True):
                traced.steps.append((name, start, end))
        return {t.name: out[t.name] for t in self._spec.outputs}

    def classify(self, images: Sequence[bytes]) -> list[list[Prediction]]:
        """Classify encoded JPEG/PNG images (any number: split into max_batch_size chunks)."""
        results: list[list[Prediction]] = []
        step = max(self.spec.max_batch_size, 1)
        for start in range(0, len(images), step):
            chunk = images[start : start + step]
            blobs = np.empty((len(chunk), 1), dtype=object)
            blobs[:, 0] = list(chunk)
            out = self.infer({self.spec.inputs[0].name: blobs})
            for scores, classes, labels in zip(
                out["scores"], out["classes"], out["labels"], strict=True
            ):
                results.append(
                    [
                        Prediction(lab.decode(), int(c), float(s))
                        for s, c, lab in zip(scores, classes, labels, strict=True)
                    ]
                )
        return results


def image_classifier(
    model: str | os.PathLike[str] | Runner = "resnet50",
    *,
    top_k: int = 5,
    labels: str | os.PathLike[str] | Sequence[str] | None = None,
    intra_op_threads: int | None = None,
    max_batch_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    decode_on: str | None = None,
) -> ImageClassifier:
    """An image classifier around a zoo model name, an ONNX file, or a Runner with one
    NCHW image input and one logits output. Zoo models are built into the cache on first use.
    ``decode_on``: where images decode (``ImageClassifier``; None: the model's GPU, if any).
    """
    if isinstance(model, Runner):
        runner: Runner = model
    else:
        path = zoo.resolve(model, cache_dir)
        runner = OnnxRuntimeRunner(
            path, intra_op_threads=intra_op_threads, max_batch_size=max_batch_size
        )
    pre, post = image_stages(
        runner.spec, getattr(runner, "metadata", None), top_k=top_k, labels=labels
    )
    return ImageClassifier(
        [pre, runner, post], ["preprocess", "model", "postprocess"], decode_on=decode_on
    )


def image_stages(
    spec: ModelSpec,
    metadata: Mapping[str, str] | None = None,
    *,
    top_k: int = 5,
    labels: str | os.PathLike[str] | Sequence[str] | None = None,
) -> tuple[Preprocess, Postprocess]:
    """The Preprocess and Postprocess around a classifier with signature ``spec``: input
    scaling and class names come from the model's metadata (the zoo writes them), labels
    from ``labels`` when given.

    Raises:
        ValueError: ``spec`` is not one NCHW square image input and one logits output.
    """
    if len(spec.inputs) != 1 or len(spec.outputs) != 1:
        raise ValueError(f"an image classifier needs one input and one output; got {spec}")
    x, y = spec.inputs[0], spec.outputs[0]
    if len(x.shape) != 3 or x.shape[0] != 3 or x.shape[1] != x.shape[2] or len(y.shape) != 1:
        raise ValueError(
            f"expected input [N,3,S,S] and output [N,classes], got "
            f"{x.name} {list(x.shape)} and {y.name} {list(y.shape)}"
        )
    meta = metadata or {}
    mean, std = input_scaling(meta)
    if labels is None and "servekit.labels" in meta:
        labels = json.loads(meta["servekit.labels"])
    crop = x.shape[1]
    pre = Preprocess(
        crop=crop,
        resize=round(crop * 256 / 224),
        mean=mean,
        std=std,
        max_batch_size=spec.max_batch_size,
        output_name=x.name,
    )
    post = Postprocess(
        num_classes=y.shape[0],
        top_k=min(top_k, y.shape[0]),
        labels=labels,
        max_batch_size=spec.max_batch_size,
        input_name=y.name,
    )
    return pre, post


def is_image_classifier(spec: ModelSpec) -> bool:
    """Whether a model looks like one: one NCHW square image input, one logits output."""
    if len(spec.inputs) != 1 or len(spec.outputs) != 1:
        return False
    x, y = spec.inputs[0].shape, spec.outputs[0].shape
    return len(x) == 3 and x[0] == 3 and x[1] == x[2] and x[1] > 0 and len(y) == 1 and y[0] > 0
