"""The reference model repository: preprocess -> ResNet-50 -> postprocess, and their ensemble.

Rendered from servekit's configuration (``ModelSpec`` + ``BatchingPolicy`` + instances ->
config.pbtxt), so the repository in git (``model_repository/``) and ``servekit repo
build`` agree by construction; weights are built into version folders, never committed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batching.policy import BatchingPolicy
from ..spec import ModelSpec
from .pbtxt import EnsembleStep, ensemble_config, model_config, render

__all__ = ["RepositoryModel", "build_repository", "reference_repository", "runner_model"]


@dataclass(frozen=True)
class RepositoryModel:
    """One model folder: its config and what its version folder needs."""

    name: str
    config: Any
    """``ModelConfig`` protobuf message."""
    weights: str | os.PathLike[str] | None = None
    """Zoo model to build into each version's ``model.onnx``, or an ONNX file to copy there."""
    versions: tuple[int, ...] = field(default=(1,))


def reference_repository(
    *,
    model: str = "resnet50",
    policy: BatchingPolicy | None = None,
    top_k: int = 5,
    instances: int = 1,
    threads: int | None = None,
) -> list[RepositoryModel]:
    """The four models of the ResNet-50 ensemble; image bytes in, top-k out."""
    policy = policy or BatchingPolicy(max_batch_size=16)
    # The stages' own signatures, so the repository can never drift from what the backend builds.
    from ..stages import Postprocess, Preprocess

    pre_spec, post_spec = Preprocess(workers=1).spec, Postprocess(top_k=top_k).spec
    (image,), (tensor,) = pre_spec.inputs, pre_spec.outputs
    (logits,), outputs = post_spec.inputs, post_spec.outputs
    mbs = policy.max_batch_size or 16
    runner_params = {"kind": "runner", "runner": "onnxruntime", "model_file": "model.onnx"}
    if threads:
        runner_params["threads"] = str(threads)
    stages = [
        RepositoryModel(
            "preprocess",
            model_config(
                "preprocess",
                ModelSpec((image,), (tensor,), mbs),
                policy,
                instance_count=instances,
                parameters={"kind": "preprocess", "resize": "256", "crop": "224"},
            ),
        ),
        RepositoryModel(
            model,
            model_config(
                model,
                ModelSpec((tensor,), (logits,), mbs),
                policy,
                instance_count=instances,
                parameters=runner_params,
            ),
            weights=model,
        ),
        RepositoryModel(
            "postprocess",
            model_config(
                "postprocess",
                ModelSpec((logits,), outputs, mbs),
                policy,
                instance_count=instances,
                parameters={"kind": "postprocess", "top_k": str(top_k), "num_classes": "1000"},
            ),
        ),
    ]
    ensemble = RepositoryModel(
        f"{model}_ensemble",
        ensemble_config(
            f"{model}_ensemble",
            (image,),
            outputs,
            [
                EnsembleStep("preprocess", {"image": "image"}, {"input": "preprocessed"}),
                EnsembleStep(model, {"input": "preprocessed"}, {"logits": "logits"}),
                EnsembleStep(
                    "postprocess",
                    {"logits": "logits"},
                    {"scores": "scores", "classes": "classes", "labels": "labels"},
                ),
            ],
            mbs,
        ),
    )
    return [*stages, ensemble]


def runner_model(
    name: str,
    model: str | os.PathLike[str],
    policy: BatchingPolicy | None = None,
    *,
    instances: int = 1,
    threads: int | None = None,
    versions: tuple[int, ...] = (1,),
    cache_dir: str | os.PathLike[str] | None = None,
) -> RepositoryModel:
    """One ONNX model (zoo name or file) on the servekit backend, its signature read
    from the model itself, batched by ``policy`` (default: up to 8, no delay)."""
    from .. import zoo
    from ..runners.onnx import OnnxRuntimeRunner

    path = zoo.resolve(model, cache_dir)
    with OnnxRuntimeRunner(path, intra_op_threads=1) as runner:
        spec = runner.spec
    parameters = {"kind": "runner", "runner": "onnxruntime", "model_file": "model.onnx"}
    if threads:
        parameters["threads"] = str(threads)
    config = model_config(
        name,
        spec,
        policy or BatchingPolicy(max_batch_size=8),
        instance_count=instances,
        parameters=parameters,
    )
    return RepositoryModel(name, config, weights=path, versions=versions)


def build_repository(
    directory: str | os.PathLike[str],
    models: list[RepositoryModel] | None = None,
    *,
    force: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write each model's config.pbtxt and version folders, building weights from the zoo.

    Existing weights are kept unless ``force``. Returns the files written.
    """
    from .. import zoo

    root = Path(directory)
    written: list[Path] = []
    for m in models or reference_repository():
        folder = root / m.name
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "config.pbtxt"
        config.write_text(render(m.config))
        written.append(config)
        for version in m.versions:
            vdir = folder / str(version)
            vdir.mkdir(exist_ok=True)
            if m.weights:
                target = vdir / "model.onnx"
                if force or not target.exists():
                    shutil.copyfile(zoo.resolve(m.weights, cache_dir), target)
                    written.append(target)
    return written
