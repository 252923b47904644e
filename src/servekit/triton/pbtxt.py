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

from ..batching.policy import BatchingPolicy, QueuePolicy, TimeoutAction
from ..spec import ModelSpec, TensorSpec

__all__ = ["EnsembleStep", "ensemble_config", "model_config", "parse", "render", "version_policy"]


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


def _queue_policy(msg: Any, q: QueuePolicy) -> None:
    pb = _pb()
    msg.timeout_action = (
        pb.ModelQueuePolicy.DELAY
        if q.timeout_action is TimeoutAction.DELAY
        else pb.ModelQueuePolicy.REJECT
    )
    msg.default_timeout_microseconds = q.default_timeout_us
    msg.allow_timeout_override = q.allow_timeout_override
    msg.max_queue_size = q.max_queue_size


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
    """A ``ModelConfig`` for one model served by ``backend`` on CPU instances."""
    pb = _pb()
    config = pb.ModelConfig(name=name, backend=backend)
    max_batch = (policy.max_batch_size if policy else 0) or spec.max_batch_size
    config.max_batch_size = max_batch if spec.batched else 0
    _tensors(config.input, spec.inputs)
    _tensors(config.output, spec.outputs)
    config.instance_group.add(count=instance_count, kind=pb.ModelInstanceGroup.KIND_CPU)
    if spec.batched and policy is not None:
        db = config.dynamic_batching
        db.preferred_batch_size.extend(policy.preferred_batch_sizes)
        db.max_queue_delay_microseconds = policy.max_queue_delay_us
        db.preserve_ordering = policy.preserve_ordering
        db.priority_levels = policy.priority_levels
        db.default_priority_level = policy.default_priority_level
        if policy.default_queue_policy != QueuePolicy():
            _queue_policy(db.default_queue_policy, policy.default_queue_policy)
        for level, q in policy.priority_queue_policies.items():
            _queue_policy(db.priority_queue_policy[level], q)
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


def batching_policy(config: Any) -> BatchingPolicy:
    """The ``BatchingPolicy`` a parsed config describes (the round trip's way back)."""
    pb = _pb()
    db = config.dynamic_batching

    def queue(msg: Any) -> QueuePolicy:
        return QueuePolicy(
            max_queue_size=msg.max_queue_size,
            default_timeout_us=msg.default_timeout_microseconds,
            timeout_action=TimeoutAction.DELAY
            if msg.timeout_action == pb.ModelQueuePolicy.DELAY
            else TimeoutAction.REJECT,
            allow_timeout_override=msg.allow_timeout_override,
        )

    return BatchingPolicy(
        max_batch_size=config.max_batch_size,
        preferred_batch_sizes=tuple(db.preferred_batch_size),
        max_queue_delay_us=db.max_queue_delay_microseconds,
        preserve_ordering=db.preserve_ordering,
        priority_levels=db.priority_levels,
        default_priority_level=db.default_priority_level,
        default_queue_policy=queue(db.default_queue_policy),
        priority_queue_policies={k: queue(v) for k, v in db.priority_queue_policy.items()},
    )
