"""Triton model repositories rendered from a ``ServeConfig`` (``servekit repo build``).

Each model becomes a folder served by the ``servekit`` backend: its config.pbtxt carries
the model's signature (read from the file), its ``BatchingPolicy`` (every knob:
``preferred_batch_size``, ``max_queue_delay_microseconds``, queue policies, priorities),
its instance count and the engine parameters; its weights go into version folders, never
into git. An image classifier also gets a preprocess and a postprocess model and an
ensemble chaining the three (``<name>_image``; the reference repository in git keeps the
names ``preprocess``, ``postprocess`` and ``resnet50_ensemble``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..batching.policy import BatchingPolicy
from ..batching.sequence import SequencePolicy
from ..batching.sequencer import served_spec
from ..config import ModelConfig, ServeConfig, image_model_name
from ..protocol.pbtxt import EnsembleStep, ensemble_config, model_config, render
from ..spec import ModelSpec
from .backend import CODE_FILE, SEQUENCE_FLAGS, SWITCH

if TYPE_CHECKING:
    from ..runtime.base import ModelProbe

__all__ = [
    "RepositoryModel",
    "build_repository",
    "model_repository",
    "reference_repository",
    "runner_model",
]

REFERENCE = ModelConfig(
    "resnet50",
    batching=BatchingPolicy(
        max_batch_size=16, preferred_batch_sizes=(4, 8), max_queue_delay_us=100
    ),
)
"""The reference workload: ResNet-50 with its ensemble, batched as the seeds' deployment
batches it (preferred batches of 4 and 8, 100 us of queue delay)."""
REFERENCE_NAMES = ("preprocess", "postprocess", "resnet50_ensemble")


@dataclass(frozen=True)
class RepositoryModel:
    """One model folder: its config and what each version folder holds."""

    name: str
    config: Any
    """``ModelConfig`` protobuf message."""
    weights: str | os.PathLike[str] | None = None
    """Zoo model to build into each version's ``model.onnx``, or an ONNX file to copy there."""
    versions: tuple[int, ...] = field(default=(1,))
    files: Mapping[str, str] = field(default_factory=dict)
    """Other files for each version folder: name -> text (a labels file)."""
    version_weights: Mapping[int, str | os.PathLike[str]] = field(default_factory=dict)
    """A version's own weights in place of ``weights`` (a model's ``[[models.versions]]``)."""
    version_files: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    """Files of one version folder only: your own model's ``code.json`` per version."""
    broken: str | None = None
    """Why the model will not load (its set-up raised when probed): tritonserver holds it
    UNAVAILABLE with its stub's words, and nobody waits for it to be ready."""


def runner_parameters(model: ModelConfig) -> dict[str, str]:
    """The servekit backend's parameters for a model: its engine and how to run it."""
    overlap = {"overlap": SWITCH[model.overlap]}
    if model.is_code:
        return {"kind": "code", **overlap}
    params = {"kind": "runner", "runner": model.engine, "model_file": "model.onnx", **overlap}
    if model.precision != "fp32":
        params["precision"] = model.precision
    if model.threads:
        params["threads"] = str(model.threads)
    if model.device:
        params["device"] = model.device
    if model.batching.preferred_batch_sizes:
        params["preferred_batch_sizes"] = ",".join(map(str, model.batching.preferred_batch_sizes))
    return params


def _image_models(
    model: ModelConfig,
    spec: ModelSpec,
    metadata: Mapping[str, str],
    names: tuple[str, str, str],
) -> list[RepositoryModel]:
    """Preprocess, postprocess and the ensemble for an image classifier."""
    from ..pipeline import image_stages

    pre, post = image_stages(spec, metadata, top_k=model.top_k, labels=model.labels)
    pre.close()
    pre_name, post_name, ensemble_name = names
    (image,), (tensor,) = pre.spec.inputs, pre.spec.outputs
    (logits,), outputs = post.spec.inputs, post.spec.outputs
    (x,), (y,) = spec.inputs, spec.outputs
    max_batch = model.batching.effective_max_batch_size(spec.max_batch_size)
    labels = "\n".join(post.labels) + "\n"
    return [
        RepositoryModel(
            pre_name,
            model_config(
                pre_name,
                ModelSpec((image,), (tensor,), max_batch),
                model.batching,
                instance_count=model.instances,
                parameters={
                    "kind": "preprocess",
                    "resize": str(pre.resize),
                    "crop": str(pre.crop),
                    "mean": ",".join(map(repr, pre.mean)),
                    "std": ",".join(map(repr, pre.std)),
                },
            ),
        ),
        RepositoryModel(
            post_name,
            model_config(
                post_name,
                ModelSpec((logits,), outputs, max_batch),
                model.batching,
                instance_count=model.instances,
                parameters={
                    "kind": "postprocess",
                    "top_k": str(post.k),
                    "num_classes": str(len(post.labels)),
                    "labels_file": "labels.txt",
                },
            ),
            files={"labels.txt": labels},
        ),
        RepositoryModel(
            ensemble_name,
            ensemble_config(
                ensemble_name,
                (image,),
                outputs,
                [
                    EnsembleStep(pre_name, {image.name: "image"}, {tensor.name: "preprocessed"}),
                    # With versions, 1 as on every runtime (the image model takes no split);
                    # else the latest, so a new version folder updates the ensemble too.
                    EnsembleStep(
                        model.name,
                        {x.name: "preprocessed"},
                        {y.name: "logits"},
                        1 if model.versions else -1,
                    ),
                    EnsembleStep(
                        post_name,
                        {logits.name: "logits"},
                        {t.name: t.name for t in outputs},
                    ),
                ],
                max_batch,
            ),
        ),
    ]


def model_repository(
    config: ServeConfig,
    *,
    versions: tuple[int, ...] = (1,),
    image_names: tuple[str, str, str] | None = None,
) -> list[RepositoryModel]:
    """Every model of ``config`` as repository folders, and beside each image classifier
    ``<name>_preprocess``, ``<name>_postprocess`` and their ensemble ``<name>_image``
    (``image_names`` renames those three, for a one-model repository)."""
    config.check("triton")
    out: list[RepositoryModel] = []
    for model in config.models:
        if model.steps:
            out += _pipeline_models(model, config)
            continue
        probe, repository_model = _model_folder(model, config, versions)
        out.append(repository_model)
        if probe.image_spec is not None:
            names = image_names or (
                f"{model.name}_preprocess",
                f"{model.name}_postprocess",
                image_model_name(model.name),
            )
            out += _image_models(model, probe.spec, probe.metadata, names)
    return out


def _model_folder(
    model: ModelConfig, config: ServeConfig, versions: tuple[int, ...] = (1,)
) -> tuple[ModelProbe, RepositoryModel]:
    """One model's folder on the servekit backend: its engine's file, or your code's
    import path (``code.json``), per version."""
    from ..runners.versioned import check_compatible
    from ..runtime.base import probe_model

    probe = probe_model(model, config.cache_dir, config.storage)
    own: dict[int, str | os.PathLike[str]] = {}
    for number in model.version_numbers[1:]:
        other = probe_model(model.for_version(number), config.cache_dir, config.storage)
        check_compatible(probe.spec, other.spec, f"{model.name} version {number}")
        own[number] = other.path
    code = {
        n: {CODE_FILE: _code_json(model.for_version(n))}
        for n in model.version_numbers
        if model.is_code
    }
    parameters = runner_parameters(model)
    spec = probe.spec
    if model.sequence_batching is not None:
        parameters["sequence"] = json.dumps(model.sequence_batching.to_dict())
        spec = served_spec(probe.spec, model.sequence_batching, model.name)
    rendered = model_config(
        model.name,
        spec,
        model.batching,
        instance_count=model.instances,
        parameters=parameters,
        versions="specific:" + ",".join(map(str, model.version_numbers)) if own else None,
    )
    if model.sequence_batching is not None:
        _sequence_batching(rendered, model.sequence_batching, probe.spec)
    if probe.decoupled:  # answered through each request's response sender, 0..N times
        rendered.model_transaction_policy.decoupled = True
    return probe, RepositoryModel(
        model.name,
        rendered,
        weights=None if model.is_code else probe.path,
        versions=model.version_numbers if own else versions,
        version_weights={} if model.is_code else own,
        version_files=code,
        broken=probe.broken,
    )


def _sequence_batching(config: Any, policy: SequencePolicy, spec: ModelSpec) -> None:
    """Triton's ``sequence_batching`` in place of ``dynamic_batching``: tritonserver
    schedules, with the model's own control inputs and the backend's (each request's
    START, END and READY: ``SEQUENCE_FLAGS``, where the model declares none of that kind);
    the servekit backend keeps the implicit
    state (Triton's Python backend has none), so no ``state`` is declared."""
    inputs = {t.name: t for t in spec.inputs}
    config.ClearField("dynamic_batching")
    own = dataclasses.replace(policy, states=())
    own.to_triton(config.sequence_batching, inputs)
    kinds = _pb_controls()
    c = policy.controls
    for mine, name, kind in (
        (c.start, SEQUENCE_FLAGS[0], kinds.CONTROL_SEQUENCE_START),
        (c.end, SEQUENCE_FLAGS[1], kinds.CONTROL_SEQUENCE_END),
        (c.ready, SEQUENCE_FLAGS[2], kinds.CONTROL_SEQUENCE_READY),
    ):
        if mine:  # Triton takes one control of a kind: the model's serves the backend too
            continue
        control = config.sequence_batching.control_input.add(name=name).control.add(kind=kind)
        control.int32_false_true.extend([0, 1])


def _pb_controls() -> Any:
    from tritonclient.grpc import model_config_pb2 as pb

    return pb.ModelSequenceBatching.Control


def _pipeline_models(model: ModelConfig, config: ServeConfig) -> list[RepositoryModel]:
    """A ``[[models.steps]]`` pipeline as Triton serves one: each step a model of its own
    (``<name>_step<i>``, batched and scaled as the pipeline) and the ensemble ``<name>``
    chaining them by tensor name, as the in-process ``Pipeline`` does."""
    from ..runtime.base import probe_model

    whole = probe_model(model, config.cache_dir, config.storage).spec  # checks the wiring
    out: list[RepositoryModel] = []
    specs: list[tuple[str, ModelSpec]] = []
    produced: set[str] = {t.name for t in whole.inputs}
    for i, step in enumerate(model.steps):
        name = f"{model.name}_step{i}"
        step = dataclasses.replace(
            step, name=name, batching=model.batching, instances=model.instances, image=False
        )
        probe, folder = _model_folder(step, config)
        again = produced & {t.name for t in probe.spec.outputs}
        if again:
            raise ValueError(
                f"pipeline {model.name}: step {i} produces {sorted(again)} again; a Triton "
                "ensemble names each tensor once"
            )
        produced |= {t.name for t in probe.spec.outputs}
        out.append(folder)
        specs.append((name, probe.spec))
    # Triton refuses an ensemble tensor nothing reads: a step's output that no later step
    # and not the pipeline's answer takes stays unmapped.
    steps: list[EnsembleStep] = []
    for i, (name, spec) in enumerate(specs):
        read = {t.name for t in whole.outputs}
        read |= {t.name for _, later in specs[i + 1 :] for t in later.inputs}
        steps.append(
            EnsembleStep(
                name,
                {t.name: t.name for t in spec.inputs},
                {t.name: t.name for t in spec.outputs if t.name in read},
            )
        )
    ensemble = ensemble_config(model.name, whole.inputs, whole.outputs, steps, whole.max_batch_size)
    return [*out, RepositoryModel(model.name, ensemble)]


def _code_json(model: ModelConfig) -> str:
    """What the backend imports for your own model's version (``CODE_FILE``)."""
    return json.dumps(
        {"source": model.source, "name": model.name, "path": model.path, "args": model.args},
        indent=2,
    )


def reference_repository(
    *,
    policy: BatchingPolicy | None = None,
    top_k: int = REFERENCE.top_k,
    instances: int = REFERENCE.instances,
    threads: int | None = REFERENCE.threads,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[RepositoryModel]:
    """The four models of the ResNet-50 ensemble; image bytes in, top-k out."""
    model = ModelConfig(
        REFERENCE.source,
        batching=policy or REFERENCE.batching,
        top_k=top_k,
        instances=instances,
        threads=threads,
    )
    cache = os.fspath(cache_dir) if cache_dir is not None else None
    return model_repository(
        ServeConfig((model,), runtime="triton", cache_dir=cache), image_names=REFERENCE_NAMES
    )


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
    """One ONNX model (zoo name or file) on the servekit backend, without an image model."""
    config = ModelConfig(
        os.fspath(model),
        name,
        batching=policy or BatchingPolicy(),
        instances=instances,
        threads=threads,
        image=False,
    )
    cache = os.fspath(cache_dir) if cache_dir is not None else None
    (only,) = model_repository(
        ServeConfig((config,), runtime="triton", cache_dir=cache), versions=versions
    )
    return only


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
    for m in models if models is not None else reference_repository(cache_dir=cache_dir):
        folder = root / m.name
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "config.pbtxt"
        config.write_text(render(m.config))
        written.append(config)
        for version in m.versions:
            vdir = folder / str(version)
            vdir.mkdir(exist_ok=True)
            for filename, text in {**m.files, **m.version_files.get(version, {})}.items():
                (vdir / filename).write_text(text)
                written.append(vdir / filename)
            weights = m.version_weights.get(version, m.weights)
            if weights:
                target = vdir / "model.onnx"
                if force or not target.exists():
                    shutil.copyfile(zoo.resolve(weights, cache_dir), target)
                    written.append(target)
    return written
