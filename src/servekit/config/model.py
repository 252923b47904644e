"""``ModelConfig``: one model, where it comes from (a zoo name, a file, your code, a
pipeline of steps), which engine runs it, how it is batched, versioned and scaled."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..autoscale import AutoscalePolicy
from ..batching.policy import BatchingPolicy
from ..batching.sequence import SequencePolicy
from ..custom import is_import_path
from ..rollout.policy import CanaryPolicy, ModelVersion, TrafficPolicy
from ..runners import ENGINES
from ..tables import check_keys
from .names import NAME, PRECISIONS, model_name

__all__ = ["IMAGE_DECODE", "ModelConfig"]

IMAGE_DECODE = re.compile(r"^(auto|host|cpu|cuda(:\d+)?)$")
"""``ModelConfig.image_decode``'s values."""


@dataclass(frozen=True)
class ModelConfig:
    """One model: where it comes from, which engine runs it, how it is batched and scaled."""

    source: str = "resnet50"
    """Zoo model name, path to an ONNX file, or your own model's import path
    (``module:attribute``: a ``servekit.Model`` subclass, an ``@infer_function``, or a
    ``Runner`` class); empty: the ``[store]`` root's model of this name (its folders)."""
    name: str = ""
    """Served name; empty = ``model_name(source)``."""
    engine: str = "onnxruntime"
    precision: str = "fp32"
    """What the engine builds at load (TensorRT, Torch); ONNX Runtime runs the file as
    written (``servekit optimize`` makes INT8/FP16 files)."""
    device: str | None = None
    """CUDA ordinal (TensorRT) or torch device (Torch); None = the engine's default."""
    batching: BatchingPolicy = field(default_factory=BatchingPolicy)
    """``max_batch_size`` 0 = the model's own (64 for an ONNX file with a dynamic batch)."""
    instances: int = 1
    """Triton's instance_group count, Ray's model replicas, the Batcher's worker threads."""
    threads: int | None = None
    """ONNX Runtime intra-op threads per instance; None = ONNX Runtime's default."""
    labels: str | None = None
    """Class names, one per line, for the image model (default: the model's own metadata)."""
    top_k: int = 5
    image: bool = True
    """Also serve ``<name>_image`` (encoded images in, top-k out) for an image classifier."""
    image_decode: str = "auto"
    """Where ``<name>_image`` decodes, resizes and scales its images: ``"auto"`` on the
    model's GPU when it runs on one that takes tensors as they are (the Torch runner on
    CUDA) and torchvision is installed, else on the host; ``"host"`` always with Pillow
    on the host; or a torch device (``"cuda:0"``, ``"cpu"``) for torchvision's decoders
    there. PNG and anything the device decoder refuses take the host path, image by image."""
    version: int = 1
    """The number ``source`` is served as: 1, except where a ``[store]`` root's Triton
    layout says otherwise (``<name>/3/model.onnx`` is version 3)."""
    version_policy: str | tuple[int, ...] = "latest"
    """Which of a ``[store]`` root's version folders (``<name>/<N>/model.onnx``) are served,
    as Triton's ``version_policy``: ``"latest"`` (the highest), ``"all"``, or the numbers.
    The versions a ``[models.traffic]`` split or shadow names are served too."""
    versions: tuple[ModelVersion, ...] = ()
    """Versions beside version 1 (``source``), each with the same signature; every one is
    loaded and served under the model's name (``/versions/<v>/`` names one)."""
    traffic: TrafficPolicy | None = None
    """How requests that name no version split over the versions (default: all to 1)."""
    canary: CanaryPolicy | None = None
    """The server's own verdict on the smallest share against the largest (needs ``traffic``)."""
    autoscale: AutoscalePolicy = field(default_factory=AutoscalePolicy)
    """The targets of ``servekit_replicas_needed``, the autoscaling signal (``servekit.autoscale``)."""
    overlap: bool | None = None
    """On the Triton runtimes, each instance takes its next batch while the device
    finishes the current one (``servekit.triton.pipeline``, ``ahead``): the hand-over
    from tritonserver to the Python stub no longer leaves the device idle. None (the
    default): where the model runs off the host's CPU (``Runner.accelerated``: a GPU, a
    simulated device); on CPU the hand-over and the model share the cores and each
    response costs the stub a message of its own. On Ray, the ingress sends each model
    replica its next batch just before the replica is expected to free (``batching.ahead``),
    holding it until then so it leaves full; this costs Ray nothing, so None means on
    there, and False gives each replica its next batch only once it has answered the last.
    Native hands a batch to its instance in-process and needs no such overlap."""
    response_cache: bool = False
    """Answer a request the model answered before from ``[server] cache`` (Triton's
    ``response_cache { enable: true }``), without running the model."""
    path: str | None = None
    """Your own model's folder, put first on ``sys.path`` in each process that imports it
    (default: the working directory the config was made in)."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """``[models.args]``: keyword arguments for your own model's ``setup`` (or its
    ``Runner`` class)."""
    steps: tuple[ModelConfig, ...] = ()
    """``[[models.steps]]``: a pipeline, served as this one model: each step (a zoo model,
    an ONNX file, your own code, a stage such as ``servekit.stages:Preprocess``) takes the
    request's tensors or an earlier step's outputs by name; ``source`` is unused."""
    sequence_batching: SequencePolicy | None = None
    """``[models.sequence_batching]``: Triton's sequence batcher in place of the dynamic
    one (a stateful model: each sequence's requests in order on one instance, control
    inputs, implicit state); ``batching.max_batch_size`` still bounds its batches."""

    def __post_init__(self) -> None:
        if isinstance(self.autoscale, Mapping):
            object.__setattr__(self, "autoscale", AutoscalePolicy.from_dict(self.autoscale))
        self._one_budget()
        object.__setattr__(self, "source", os.fspath(self.source))
        if self.steps:
            self._check_steps()
        if not self.source and not self.name:
            raise ValueError(
                "a model needs a source (a zoo name, a file, your code), or a name that a "
                "[store] root holds"
            )
        if not self.name:
            object.__setattr__(self, "name", model_name(self.source))
        if not NAME.match(self.name):
            raise ValueError(
                f"model name must be letters, digits, '_', '.' or '-', got {self.name!r}"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        for key in ("instances", "top_k"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.labels is not None:
            object.__setattr__(self, "labels", os.fspath(self.labels))
        if not IMAGE_DECODE.match(self.image_decode):
            raise ValueError(
                f"model {self.name!r}: image_decode must be 'auto', 'host', 'cpu', 'cuda' or "
                f"'cuda:<n>', got {self.image_decode!r}"
            )
        self._check_code()
        self._check_rollout()
        if isinstance(self.sequence_batching, Mapping):
            object.__setattr__(
                self,
                "sequence_batching",
                SequencePolicy.from_dict(self.sequence_batching, "models.sequence_batching"),
            )
        if self.sequence_batching is not None and (self.versions or self.traffic or self.steps):
            raise ValueError(
                f"model {self.name!r}: sequence_batching with versions, a traffic split or "
                "pipeline steps is not served (a sequence's state lives on one model)"
            )

    def _one_budget(self) -> None:
        """A batching budget is the autoscaling signal's budget too (one number)."""
        budget = self.batching.latency_budget_ms
        scaling = self.autoscale.latency_budget_ms
        if not budget or scaling == budget:
            return
        if scaling != AutoscalePolicy.latency_budget_ms:
            raise ValueError(
                f"model {self.name or self.source!r}: [models.batching] latency_budget_ms = "
                f"{budget:g} and [models.autoscale] latency_budget_ms = {scaling:g}: give the "
                "budget once, in [models.batching] (the autoscaling signal takes it from there)"
            )
        autoscale = dataclasses.replace(self.autoscale, latency_budget_ms=budget)
        object.__setattr__(self, "autoscale", autoscale)

    @property
    def is_code(self) -> bool:
        """Whether ``source`` is your own Python model (an import path)."""
        return not self.steps and is_import_path(self.source)

    @property
    def has_file(self) -> bool:
        """Whether ``source`` is a model file (a zoo name, a path, an object): not code,
        not a pipeline."""
        return not self.steps and not self.is_code

    def _check_steps(self) -> None:
        if not self.name:
            raise ValueError("a pipeline ([[models.steps]]) needs a name")
        steps = tuple(
            s if isinstance(s, ModelConfig) else ModelConfig.from_dict(s, f"{self.name}.steps.{i}")
            for i, s in enumerate(self.steps)
        )
        object.__setattr__(self, "steps", steps)
        for i, step in enumerate(steps):
            if step.steps or step.versions or step.traffic or step.canary:
                raise ValueError(
                    f"model {self.name!r}: step {i} ({step.name}) has steps, versions or a "
                    "traffic split of its own; a pipeline's steps are single models"
                )
        if self.versions:
            raise ValueError(
                f"model {self.name!r}: a pipeline has no [[models.versions]] yet; serve each "
                "version as a pipeline of its own"
            )
        object.__setattr__(self, "source", "pipeline")
        object.__setattr__(self, "image", False)

    def _check_code(self) -> None:
        if not isinstance(self.args, Mapping):
            raise ValueError(
                f"model {self.name!r}: [models.args] must be a table, got {self.args!r}"
            )
        object.__setattr__(self, "args", dict(self.args))
        if self.path is not None:
            object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))
        elif self.is_code:  # where the name was given, for processes that start elsewhere
            object.__setattr__(self, "path", os.getcwd())
        if not self.is_code:
            for key in ("path", "args"):
                if getattr(self, key):
                    raise ValueError(
                        f"model {self.name!r}: {key} is for your own model (source = "
                        f'"module:attribute"), not {self.source!r}'
                    )
        elif self.engine != "onnxruntime" or self.precision != "fp32":
            raise ValueError(
                f"model {self.name!r}: {self.source} is your own code: engine and precision "
                f"are its own, not {self.engine!r}/{self.precision!r}"
            )

    def _check_rollout(self) -> None:
        versions = tuple(
            v if isinstance(v, ModelVersion) else ModelVersion.from_dict(v) for v in self.versions
        )
        object.__setattr__(self, "versions", versions)
        if self.version < 1:
            raise ValueError(f"model {self.name!r}: version must be >= 1, got {self.version}")
        self._check_version_policy()
        numbers = [self.version, *(v.version for v in versions)]
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"model {self.name!r}: versions must be unique, got {numbers}")
        if isinstance(self.traffic, Mapping):
            object.__setattr__(self, "traffic", TrafficPolicy.from_dict(self.traffic))
        if isinstance(self.canary, Mapping):
            object.__setattr__(self, "canary", CanaryPolicy.from_dict(self.canary))
        traffic = self.traffic
        if traffic is not None and self.source:  # a store's model: its folders tell (catalog)
            unknown = [v for v in self.named_versions if v not in numbers]
            if unknown:
                raise ValueError(
                    f"model {self.name!r}: [models.traffic] names version(s) {unknown}; "
                    f"the model has {numbers} (add them under [[models.versions]], or leave "
                    "out source to serve a [store] root's version folders)"
                )
        judged = {*traffic.split, traffic.shadow} - {None} if traffic is not None else set()
        if self.canary is not None and len(judged) < 2:
            raise ValueError(
                f"model {self.name!r}: [models.canary] needs a [models.traffic] split over "
                "two versions, or a shadow beside one (the canary is the smaller share)"
            )

    def _check_version_policy(self) -> None:
        policy = self.version_policy
        if isinstance(policy, Sequence) and not isinstance(policy, str):
            numbers = tuple(policy)
            if not numbers or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in numbers
            ):
                raise ValueError(
                    f'model {self.name!r}: version_policy: expected "latest", "all" or '
                    f"a list of version numbers >= 1, got {list(policy)!r}"
                )
            object.__setattr__(self, "version_policy", tuple(sorted(set(numbers))))
        elif policy not in ("latest", "all"):
            raise ValueError(
                f'model {self.name!r}: version_policy: expected "latest", "all" or a '
                f"list of version numbers, got {policy!r}"
            )

    @property
    def named_versions(self) -> tuple[int, ...]:
        """The versions ``[models.traffic]`` names (its split and its shadow)."""
        if self.traffic is None:
            return ()
        shadow = [self.traffic.shadow] if self.traffic.shadow else []
        return tuple(sorted({*self.traffic.split, *shadow}))

    @property
    def version_numbers(self) -> tuple[int, ...]:
        """Its own version (1 but in a store's Triton layout) and every version beside it."""
        return (self.version, *(v.version for v in self.versions))

    def for_version(self, version: int) -> ModelConfig:
        """The model as one of its versions: that version's source, no rollout of its own."""
        sources = {self.version: self.source, **{v.version: v.source for v in self.versions}}
        if version not in sources:
            raise ValueError(
                f"model {self.name!r} has no version {version}; it has {sorted(sources)}"
            )
        source = sources[version]
        return dataclasses.replace(
            self, source=source, name=self.name, versions=(), traffic=None, canary=None
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``[[models]]`` table (``from_dict``'s inverse); None values are left out."""
        rollout = (
            "batching", "versions", "traffic", "canary", "autoscale", "steps", "sequence_batching"
        )  # fmt: skip
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in rollout and getattr(self, f.name) is not None
        }
        data["batching"] = self.batching.to_dict()
        if self.version == 1:
            del data["version"]
        if self.version_policy == "latest":
            del data["version_policy"]
        elif not isinstance(self.version_policy, str):
            data["version_policy"] = list(self.version_policy)
        if not self.args:
            del data["args"]
        if self.steps:
            data["steps"] = [s.to_dict() for s in self.steps]
            del data["source"], data["image"]
        if self.versions:
            data["versions"] = [dataclasses.asdict(v) for v in self.versions]
        if self.traffic is not None:
            data["traffic"] = self.traffic.to_dict()
        if self.canary is not None:
            data["canary"] = self.canary.to_dict()
        if self.autoscale != AutoscalePolicy():
            data["autoscale"] = self.autoscale.to_dict()
        if self.sequence_batching is not None:
            data["sequence_batching"] = self.sequence_batching.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "models") -> ModelConfig:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        kwargs = dict(data)
        kwargs["batching"] = BatchingPolicy.from_dict(
            data.get("batching", {}), f"{section}.batching"
        )
        raw = data.get("versions", [])
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise ValueError(f"[[{section}.versions]]: expected a list of tables, got {raw!r}")
        kwargs["versions"] = tuple(
            ModelVersion.from_dict(v, f"{section}.versions.{i}") for i, v in enumerate(raw)
        )
        steps = data.get("steps", [])
        if not isinstance(steps, Sequence) or isinstance(steps, str):
            raise ValueError(f"[[{section}.steps]]: expected a list of tables, got {steps!r}")
        kwargs["steps"] = tuple(
            ModelConfig.from_dict(v, f"{section}.steps.{i}") for i, v in enumerate(steps)
        )
        if "traffic" in data:
            kwargs["traffic"] = TrafficPolicy.from_dict(data["traffic"], f"{section}.traffic")
        if "canary" in data:
            kwargs["canary"] = CanaryPolicy.from_dict(data["canary"], f"{section}.canary")
        if "autoscale" in data:
            kwargs["autoscale"] = AutoscalePolicy.from_dict(
                data["autoscale"], f"{section}.autoscale"
            )
        if "sequence_batching" in data:
            kwargs["sequence_batching"] = SequencePolicy.from_dict(
                data["sequence_batching"], f"{section}.sequence_batching"
            )
        return cls(**kwargs)
