"""config.pbtxt from servekit's configuration, through Triton's own ``model_config.proto``.

The same ``ModelSpec`` and ``BatchingPolicy`` that configure PyTriton and servekit's
``Batcher`` render here to Triton's text format; building the protobuf message (as
shipped in tritonclient) means every rendered file is valid by construction and parses
back (``parse``) for a round trip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..batching.policy import BatchingPolicy
from ..spec import ModelSpec, TensorSpec

__all__ = [
    "QUEUE_DELAYS",
    "EnsembleStep",
    "budget_parameters",
    "ensemble_config",
    "model_config",
    "parse",
    "render",
    "version_policy",
]


def _pb() -> Any:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


@dataclass(frozen=True)
class EnsembleStep:
    """One ensemble step: ``input_map``/``output_map`` go from the step model's tensor
    names to the ensemble's tensor names."""

    model: str
    input_map: Mapping[str, str] = field(default_factory=dict)
    output_map: Mapping[str, str] = field(default_factory=dict)
    version: int = -1


def _tensors(target: Any, tensors: Sequence[TensorSpec]) -> None:
    pb = _pb()
    for t in tensors:
        msg = target.add()
        msg.name = t.name
        msg.data_type = pb.DataType.Value(t.dtype.triton)
        msg.dims.extend(t.shape)


QUEUE_DELAYS = ("fixed", "adaptive")
"""How a latency budget's queue delay is served: ``fixed`` (tritonserver's dynamic batcher
holds every batch ``max_queue_delay_microseconds``, ``BatchingPolicy.static_delay_us``) or
``adaptive`` (servekit's ``Batcher`` chooses each batch's hold: the field says the last)."""


def budget_parameters(policy: BatchingPolicy, queue_delay: str) -> dict[str, str]:
    """A latency budget as a model configuration's ``parameters`` say it (servekit's own
    knobs: Triton's ``ModelConfig`` has no field for them), and how the delay in
    ``dynamic_batching.max_queue_delay_microseconds`` is chosen; empty without a budget.

    Raises:
        ValueError: ``queue_delay`` is not one of ``QUEUE_DELAYS``.
    """
    if queue_delay not in QUEUE_DELAYS:
        raise ValueError(f"queue_delay must be one of {list(QUEUE_DELAYS)}, got {queue_delay!r}")
    if not policy.latency_budget_ms:
        return {}
    return {
        "latency_budget_ms": f"{policy.latency_budget_ms:g}",
        "latency_percentile": f"{policy.latency_percentile:g}",
        "queue_delay": queue_delay,
    }


def version_policy(spec: str) -> Any:
    """``"latest:N"``, ``"all"`` or ``"specific:1,3"`` as a ``ModelVersionPolicy``."""
    pb = _pb()
    policy = pb.ModelVersionPolicy()
    kind, _, arg = spec.partition(":")
    if kind == "latest":
        policy.latest.num_versions = int(arg or 1)
    elif kind == "all":
        policy.all.SetInParent()
    elif kind == "specific" and arg:
        policy.specific.versions.extend(int(v) for v in arg.split(","))
    else:
        raise ValueError(f"version policy must be latest:N, all or specific:V[,V...], got {spec!r}")
    return policy


def model_config(
    name: str,
    spec: ModelSpec,
    policy: BatchingPolicy | None = None,
    *,
    backend: str = "servekit",
    instance_count: int = 1,
    parameters: Mapping[str, str] | None = None,
    versions: str | None = None,
) -> Any:
    """A ``ModelConfig`` for one model served by ``backend`` on CPU instances, batched by
    ``policy`` (``BatchingPolicy.to_triton``; None = the default policy). A latency budget
    is tritonserver's fixed delay, and its ``parameters`` say so (``budget_parameters``)."""
    pb = _pb()
    config = pb.ModelConfig(name=name, backend=backend)
    policy = policy or BatchingPolicy()
    policy.to_triton(config, spec.max_batch_size)
    if config.max_batch_size:
        for key, value in budget_parameters(policy, "fixed").items():
            config.parameters[key].string_value = value
    _tensors(config.input, spec.inputs)
    _tensors(config.output, spec.outputs)
    config.instance_group.add(count=instance_count, kind=pb.ModelInstanceGroup.KIND_CPU)
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    if versions:
        config.version_policy.CopyFrom(version_policy(versions))
    return config


def ensemble_config(
    name: str,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    steps: Sequence[EnsembleStep],
    max_batch_size: int,
) -> Any:
    """An ensemble (``platform: "ensemble"``) chaining ``steps``."""
    pb = _pb()
    config = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=max_batch_size)
    _tensors(config.input, inputs)
    _tensors(config.output, outputs)
    for step in steps:
        msg = config.ensemble_scheduling.step.add(model_name=step.model, model_version=step.version)
        for k, v in step.input_map.items():
            msg.input_map[k] = v
        for k, v in step.output_map.items():
            msg.output_map[k] = v
    return config


def render(config: Any) -> str:
    """Triton's text format."""
    from google.protobuf import text_format

    return str(text_format.MessageToString(config))


def parse(text: str) -> Any:
    """Parse config.pbtxt text into a ``ModelConfig`` (raises on unknown fields)."""
    from google.protobuf import text_format

    return text_format.Parse(text, _pb().ModelConfig())
