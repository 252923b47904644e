"""Triton's extensions as servekit's front answers them, from what a ``FrontModel``
declares: the model configuration in force, statistics from its ``Batcher``'s counters,
the repository index, server metadata. HTTP and gRPC both answer from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._version import __version__
from ..batching.sequencer import SequenceBatcher
from ..errors import InvalidInput
from .jsonbody import parse_json
from .models import FrontModel, unready_reason
from .pbtxt import budget_parameters
from .pbtxt import model_config as render

__all__ = [
    "EXTENSIONS",
    "NOT_SERVED",
    "model_config",
    "ready_only_asked",
    "repository_index",
    "server_metadata",
    "statistics",
]

EXTENSIONS = (
    "classification",
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "schedule_policy",
    "model_repository",
)
"""What the front implements (``model_repository``: the index only; loading and
unloading are Triton's control APIs, see ``NOT_SERVED``)."""

NOT_SERVED = (
    "is not served by servekit's front here: model control (load, unload) needs a [store] "
    "(native) or tritonserver behind the front (triton); shared-memory registration, trace "
    "and logging are Triton's control APIs, served on the gRPC port of the triton and "
    "pytriton runtimes with the servekit-control-token"
)


def server_metadata() -> dict[str, Any]:
    return {"name": "servekit", "version": __version__, "extensions": list(EXTENSIONS)}


def model_config(name: str, model: FrontModel) -> Any:
    """Triton's ``ModelConfig`` message for ``model`` as served: its signature, and the
    batching policy and instance count of its ``Batcher`` (none: no dynamic batching; a
    ``SequenceBatcher``: Triton's ``sequence_batching`` with its controls and state)."""
    batcher = model.batcher
    policy = batcher.policy if batcher is not None else None
    instances = batcher.instance_count if batcher is not None else 1
    config = render(name, model.spec, policy, instance_count=instances)
    if batcher is None or isinstance(batcher, SequenceBatcher):
        config.ClearField("dynamic_batching")
    elif policy is not None and policy.latency_budget_ms:
        _budget_in_force(config, batcher)
    if isinstance(batcher, SequenceBatcher):
        inputs = {t.name: t for t in batcher.model_spec.inputs}
        batcher.sequence.to_triton(config.sequence_batching, inputs)
    return config


def model_config_json(name: str, model: FrontModel) -> dict[str, Any]:
    """``GET /v2/models/{name}/config``: the message as Triton's HTTP API writes it."""
    from google.protobuf import json_format

    return json_format.MessageToDict(model_config(name, model), preserving_proto_field_name=True)


def _budget_in_force(config: Any, batcher: Any) -> None:
    """A latency budget as its batcher holds it: the budget and percentile in
    ``parameters`` (servekit's own knobs) with ``queue_delay = adaptive``, and, since no
    fixed delay is in force, the batch hold it uses now (``max_queue_delay_microseconds``:
    the last batch's, 0 before any) beside the part of the budget the holds use and the
    target rows."""
    policy, budget = batcher.policy, batcher.budget
    figures = budget.figures() if budget is not None else {}
    config.dynamic_batching.max_queue_delay_microseconds = round(figures.get("held_s", 0) * 1e6)
    params = budget_parameters(policy, "adaptive")
    if figures:
        params["working_budget_ms"] = f"{figures['working_s'] * 1e3:g}"
        params["target_rows"] = f"{figures['target_rows']:g}"
    for key, value in params.items():
        config.parameters[key].string_value = value


def _duration(count: int, us: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(us * 1000)}


def statistics(models: Mapping[str, FrontModel]) -> dict[str, Any]:
    """Triton's statistics JSON (``model_stats``) from each model's ``Batcher`` counters;
    a model without a Batcher reports zeros."""
    out = []
    for name, model in models.items():
        s = model.batcher.stats.snapshot() if model.batcher is not None else None
        ok = s.request_success if s else 0
        failed = (s.request_failure + s.request_invalid) if s else 0
        queue_us = s.queue_us if s else 0.0
        compute_us = s.compute_us if s else 0.0
        executions = s.execution_count if s else 0
        out.append(
            {
                "name": name,
                "version": "1",
                "last_inference": 0,
                "inference_count": s.inference_count if s else 0,
                "execution_count": executions,
                "inference_stats": {
                    "success": _duration(ok, queue_us + compute_us),
                    "fail": _duration(failed, 0),
                    "queue": _duration(ok, queue_us),
                    "compute_input": _duration(executions, 0),
                    "compute_infer": _duration(executions, compute_us),
                    "compute_output": _duration(executions, 0),
                    "cache_hit": _duration(0, 0),
                    "cache_miss": _duration(0, 0),
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": _duration(n, 0),
                        "compute_infer": _duration(n, 0),
                        "compute_output": _duration(n, 0),
                    }
                    for size, n in sorted((s.batch_rows if s else {}).items())
                ],
            }
        )
    return {"model_stats": out}


def repository_index(models: Mapping[str, FrontModel]) -> list[dict[str, str]]:
    """``POST /v2/repository/index``: every version of every model served, ready, or
    ``UNAVAILABLE`` with the reason where none of its instances can serve."""
    index = []
    for n in sorted(models):
        why = unready_reason(models[n])
        for v in models[n].versions or ("1",):
            row = {"name": n, "version": v, "state": "READY"}
            if why:
                row.update(state="UNAVAILABLE", reason=why)
            index.append(row)
    return index


def ready_only_asked(body: bytes) -> bool:
    """Whether a repository index request's body (``{"ready": bool}``, or none) asks for
    ready models only; anything else is refused naming what came, as Triton checks it."""
    if not body.strip():
        return False
    data = parse_json(body, "repository index request")
    if not isinstance(data, dict):
        raise InvalidInput(
            f"repository index request: expected a JSON object, got {type(data).__name__}"
        )
    ready = data.get("ready", False)
    if type(ready) is not bool:
        raise InvalidInput(
            f"repository index request: 'ready': expected true or false, got {ready!r}"
        )
    return ready
