"""What every runtime shares: the ``Runtime`` contract and the one way a model is loaded.

A runtime is a thin adapter: it takes a ``ServeConfig``, loads each model through
``load_models`` (the engine switch, the image model beside a classifier, the version
wrapper for live updates), renders the batching policy to its own form and serves.
The ``Supervisor`` drives any runtime the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..batching.policy import BatchingPolicy
from ..batching.sequence import SequencePolicy
from ..config import ModelConfig, ServeConfig, image_model_name
from ..errors import UpdateRefused
from ..runners.base import Runner, overlaps
from ..runners.versioned import VersionedRunner, check_compatible
from ..spec import ModelSpec
from ..storage import StorageConfig

log = logging.getLogger(__name__)

__all__ = [
    "ModelProbe",
    "Runtime",
    "ServedModel",
    "load_model_runner",
    "load_models",
    "load_or_unready",
    "probe_model",
    "refresh",
    "reload_models",
]


@dataclass(frozen=True)
class ServedModel:
    """One model as a runtime serves it: a name, a Runner, its batching policy and instances."""

    name: str
    runner: Runner
    policy: BatchingPolicy = field(default_factory=BatchingPolicy)
    instance_count: int = 1
    version: int = 1
    """Which of the model's versions this is (``ModelConfig.versions``); 1 without any."""
    sequence: SequencePolicy | None = None
    """Triton's sequence batcher in place of the dynamic one (``sequence_batching``)."""
    overlap: bool | None = None
    """``ModelConfig.overlap``: the next batch handed over while the device runs one
    (None: where the runner is ``accelerated``)."""

    @property
    def overlaps(self) -> bool:
        """Whether this model's instances overlap, ``overlap`` resolved."""
        return overlaps(self.overlap, self.runner)

    def __post_init__(self) -> None:
        if self.instance_count < 1:
            raise ValueError(f"{self.name}: instance_count must be >= 1, got {self.instance_count}")


@runtime_checkable
class Runtime(Protocol):
    """A server the ``Supervisor`` can start, watch, reload and stop."""

    def start(self) -> object:
        """Load and warm up every model, then listen; returns once every model is ready."""
        ...

    def stop(self) -> None:
        """Stop listening (waiting for requests in flight) and release every model."""
        ...

    def problem(self) -> str | None:
        """Why the runtime cannot serve right now (a dead process, say), or None."""
        ...

    def restart(self) -> None:
        """Stop and start again on the same ports."""
        ...

    def reload(self) -> list[str]:
        """Read every model's file again and serve it (a live update where the runtime can);
        returns what it did, one line per model. A model that fails to load raises and the
        serving version stays."""
        ...


def static_budgets(config: ServeConfig) -> list[str]:
    """One line per model whose latency budget tritonserver's own batcher cannot adapt to
    (the Triton runtimes): the fixed delay it is served with instead."""
    return [
        f"model {m.name}: tritonserver's dynamic batcher assembles its batches, so "
        f"latency_budget_ms = {m.batching.latency_budget_ms:g} is served as a fixed "
        f"max_queue_delay_us = {m.batching.static_delay_us()} (the budget adapts each batch "
        "on the native and ray runtimes)"
        for m in config.models
        if m.batching.latency_budget_ms and not m.steps
    ]


def is_decoupled(runner: Runner) -> bool:
    """Whether ``runner`` answers a request with any number of responses (``decoupled``)."""
    return bool(getattr(runner, "decoupled", False))


def refuse_decoupled(runner: Runner, name: str, runtime: str) -> None:
    """``ValueError`` naming ``runtime`` and the model where ``runner`` is decoupled (the
    runtime cannot stream its responses)."""
    if is_decoupled(runner):
        raise ValueError(
            f"the {runtime} runtime cannot serve model {name!r}: it is decoupled (answers a "
            "request with any number of responses), which servekit's front streams"
        )


def load_model_runner(
    model: ModelConfig,
    cache_dir: str | None = None,
    storage: StorageConfig | None = None,
    path: Path | None = None,
) -> Runner:
    """The model's file on its engine, read from disk now (what a reload runs again);
    ``path`` is the file ``zoo.resolve`` found for it, when the caller has it already.

    Raises:
        ModelNotFound: the zoo name, object or file does not exist.
        FetchFailed: the object could not be fetched from its store.
        ValueError: the file does not load, naming it and the engine's error.
    """
    from .. import zoo
    from ..errors import ServekitError
    from ..runners import load_runner

    if model.is_code:
        from ..custom import import_model

        return import_model(model.source, name=model.name, path=model.path, args=model.args)
    if model.steps:
        return _pipeline(model, cache_dir, storage)
    path = path or zoo.resolve(model.source, cache_dir, storage)
    try:
        return load_runner(
            path,
            engine=model.engine,
            precision=model.precision,
            max_batch_size=model.batching.max_batch_size or None,
            preferred_batch_sizes=model.batching.preferred_batch_sizes,
            threads=model.threads,
            device=model.device,
            instances=model.instances,
        )
    except (ValueError, ServekitError):
        raise
    except Exception as exc:
        raise ValueError(f"{model.source}: cannot load: {type(exc).__name__}: {exc}") from None


def _pipeline(model: ModelConfig, cache_dir: str | None, storage: StorageConfig | None) -> Runner:
    """A ``[[models.steps]]`` pipeline as one Runner, each step batched as the pipeline is;
    a step that does not fit the ones before it is refused naming both."""
    from ..pipeline import Pipeline

    runners: list[Runner] = []
    try:
        for step in model.steps:
            batched = dataclasses.replace(step, batching=model.batching)
            runners.append(load_model_runner(batched, cache_dir, storage))
        return Pipeline(runners, [step.name for step in model.steps])
    except BaseException as exc:
        for runner in runners:  # the steps loaded so far: nothing half-built stays open
            runner.close()
        if isinstance(exc, ValueError):
            raise ValueError(f"pipeline {model.name}: {exc}") from None
        raise


def _versioned(
    model: ModelConfig, name: str, cache_dir: str | None, storage: StorageConfig | None
) -> VersionedRunner:
    from .. import zoo

    path = zoo.resolve(model.source, cache_dir, storage) if model.has_file else None
    runner = VersionedRunner(load_model_runner(model, cache_dir, storage, path), name=name)
    runner.origin = path
    return runner


def load_models(
    model: ModelConfig, cache_dir: str | None = None, storage: StorageConfig | None = None
) -> list[ServedModel]:
    """The tensor model (each of its versions) and, for an image classifier with
    ``model.image``, its image model (encoded images in, top-k out; over version 1). A model
    and its image model share one ``VersionedRunner``, so an update of the tensor model
    updates both.

    Raises:
        UpdateRefused: a version's signature differs from version 1's, naming the difference.
    """
    from ..pipeline import image_classifier, is_image_classifier

    runner = _versioned(model, model.name, cache_dir, storage)
    served = [
        ServedModel(
            model.name,
            runner,
            model.batching,
            model.instances,
            sequence=model.sequence_batching,
            overlap=model.overlap,
        )
    ]
    for number in model.version_numbers[1:]:
        versioned = _versioned(
            model.for_version(number), f"{model.name} v{number}", cache_dir, storage
        )
        try:
            check_compatible(runner.spec, versioned.spec, f"{model.name} version {number}")
        except UpdateRefused:
            versioned.close()
            raise
        served.append(
            ServedModel(
                model.name,
                versioned,
                model.batching,
                model.instances,
                number,
                overlap=model.overlap,
            )  # fmt: skip
        )
    if model.image and runner.spec.batched and is_image_classifier(runner.spec):
        decode_on = None if model.image_decode == "auto" else model.image_decode
        clf = image_classifier(runner, top_k=model.top_k, labels=model.labels, decode_on=decode_on)
        served.append(
            ServedModel(
                image_model_name(model.name),
                clf,
                model.batching,
                model.instances,
                overlap=model.overlap,
            )  # fmt: skip
        )
    return served


def load_or_unready(
    model: ModelConfig, cache_dir: str | None = None, storage: StorageConfig | None = None
) -> list[ServedModel]:
    """``load_models``, but a model whose set-up raised (``SetupFailed``) and that declares
    its signature is served ``Unready``: not ready, its reason the set-up's words, instead
    of refusing the start (every in-process runtime and Ray's replicas)."""
    from ..errors import SetupFailed
    from ..runners.broken import Unready

    try:
        return load_models(model, cache_dir, storage)
    except SetupFailed as exc:
        if not isinstance(exc.spec, ModelSpec) or not exc.spec.batched:
            raise  # no signature known, or none the batcher takes: the start is refused
        log.error("%s; it is served not ready", exc)
        runner = VersionedRunner(Unready(exc.spec, str(exc)), name=model.name)
        return [ServedModel(model.name, runner, model.batching, model.instances)]


def reload_models(config: ServeConfig, served: Iterable[ServedModel]) -> list[str]:
    """Read each configured model's file again and swap it into its ``VersionedRunner``
    (the in-process runtimes' SIGHUP); returns one line per model. A model from object
    storage is re-checked against its store and swapped only when the object changed."""
    by_name = {(m.name, m.version): m.runner for m in served}
    done = []
    for model in config.models:
        for version in model.version_numbers:
            versioned = by_name[(model.name, version)]
            assert isinstance(versioned, VersionedRunner)
            which = f"{model.name}" if version == 1 else f"{model.name} version {version}"
            source = model.for_version(version)
            number = refresh(versioned, source, config.cache_dir, config.storage)
            # ``number`` counts the runner's swaps (its reloads), not the model's versions.
            if number is None:
                done.append(f"{which}: unchanged ({source.source}), not reloaded")
            else:
                done.append(f"{which}: reloaded from {source.source} (reload {number - 1})")
    return done


def refresh(
    versioned: VersionedRunner,
    model: ModelConfig,
    cache_dir: str | None = None,
    storage: StorageConfig | None = None,
) -> int | None:
    """Swap the model's file in between batches; returns the new version number, or None
    for a model from object storage whose object has not changed (nothing to swap)."""
    from .. import zoo
    from ..storage import is_remote

    path = zoo.resolve(model.source, cache_dir, storage) if model.has_file else None
    if is_remote(model.source) and path == versioned.origin:
        return None
    number = versioned.update(load_model_runner(model, cache_dir, storage, path))
    versioned.origin = path
    return number


@dataclass(frozen=True)
class ModelProbe:
    """What a runtime that loads models elsewhere (Ray's replicas, Triton's backend) needs to
    know first: the file (your own model's import path), its signature and metadata, and
    the image model's signature (None when no image model is served)."""

    path: Path
    spec: ModelSpec
    metadata: dict[str, str]
    image_spec: ModelSpec | None
    decoupled: bool = False
    """Your own model answers a request with any number of responses (``decoupled``)."""
    broken: str | None = None
    """Why the model cannot serve (its set-up raised: ``SetupFailed``); its declared
    signature is ``spec``, and it is served not ready."""


def probe_model(
    model: ModelConfig, cache_dir: str | None = None, storage: StorageConfig | None = None
) -> ModelProbe:
    """Load the model's file once with ONNX Runtime (the signature is the file's, whatever
    engine serves it) to read its signature; a file that does not load fails here, naming it.
    Your own model is imported and set up here once for the same reason (never pickled:
    each process that serves it imports it again).
    """
    from .. import zoo
    from ..errors import SetupFailed
    from ..pipeline import ImageClassifier, image_stages, is_image_classifier

    probe = dataclasses.replace(
        model, engine="onnxruntime", precision="fp32", device=None, threads=1
    )
    path = zoo.resolve(model.source, cache_dir, storage) if model.has_file else Path(model.source)
    try:
        runner = load_model_runner(probe, cache_dir, storage, path)
    except SetupFailed as exc:
        if not isinstance(exc.spec, ModelSpec):
            raise
        log.error("%s; it is served not ready", exc)
        return ModelProbe(path, exc.spec, {}, None, broken=str(exc))
    try:
        spec = runner.spec
        meta = dict(getattr(runner, "metadata", None) or {})
        image_spec = None
        if model.image and spec.batched and is_image_classifier(spec):
            pre, post = image_stages(spec, meta, top_k=model.top_k, labels=model.labels)
            image_spec = ImageClassifier([pre, runner, post]).spec
            pre.close()
        return ModelProbe(path, spec, meta, image_spec, is_decoupled(runner))
    finally:
        runner.close()
