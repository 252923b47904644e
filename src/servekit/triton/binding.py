"""servekit models on PyTriton: the spec and policy rendered to PyTriton, and the infer callable.

Triton's C++ dynamic batcher forms the batches (from the rendered ``BatchingPolicy``);
each batch reaches ``infer_callable``, which validates every request, runs the valid
ones together and answers each request on its own (``batching.run_requests``). A
request that fails alone gets its own error with the right code through the stub
shim (``_stub_shim.py``), instead of PyTriton's one INTERNAL error for the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..batching.execute import run_requests
from ..batching.policy import BatchingPolicy, QueuePolicy
from ..errors import ServekitError, triton_code
from ..spec import ModelSpec, TensorSpec
from .env import TritonSetupError

__all__ = [
    "ERROR_OUTPUT",
    "error_response",
    "infer_callable",
    "install_error_shim",
    "pytriton_batcher",
    "pytriton_model_config",
    "pytriton_tensors",
]

ERROR_OUTPUT = "__servekit_error__"
"""Pseudo-output that carries (code, message) for one request to the stub shim."""

_SHIMMED: set[str] = set()


def pytriton_tensors(tensors: Sequence[TensorSpec]) -> list[Any]:
    """``TensorSpec``s as PyTriton ``Tensor``s (BYTES as ``np.bytes_``)."""
    from pytriton.model_config import Tensor

    return [
        Tensor(
            name=t.name,
            dtype=np.bytes_ if t.dtype.datatype == "BYTES" else t.dtype.numpy.type,
            shape=t.shape,
        )
        for t in tensors
    ]


def _queue_policy(q: QueuePolicy) -> Any:
    from pytriton.model_config.common import QueuePolicy as PtQueuePolicy
    from pytriton.model_config.common import TimeoutAction as PtTimeoutAction

    return PtQueuePolicy(
        timeout_action=PtTimeoutAction(q.timeout_action.value),
        default_timeout_microseconds=q.default_timeout_us,
        allow_timeout_override=q.allow_timeout_override,
        max_queue_size=q.max_queue_size,
    )


def pytriton_batcher(policy: BatchingPolicy) -> Any:
    """A ``BatchingPolicy`` as PyTriton's ``DynamicBatcher`` (same knobs, Triton's field names)."""
    from pytriton.model_config import DynamicBatcher

    return DynamicBatcher(
        max_queue_delay_microseconds=policy.max_queue_delay_us,
        preferred_batch_size=list(policy.preferred_batch_sizes) or None,
        preserve_ordering=policy.preserve_ordering,
        priority_levels=policy.priority_levels,
        default_priority_level=policy.default_priority_level,
        default_queue_policy=_queue_policy(policy.default_queue_policy),
        priority_queue_policy={
            k: _queue_policy(v) for k, v in policy.priority_queue_policies.items()
        }
        or None,
    )


def pytriton_model_config(spec: ModelSpec, policy: BatchingPolicy) -> Any:
    """PyTriton ``ModelConfig``: batching on when the spec batches, the policy's limits."""
    from pytriton.model_config import ModelConfig

    if not spec.batched:
        return ModelConfig(batching=False)
    max_batch = policy.max_batch_size or spec.max_batch_size
    if max_batch > spec.max_batch_size:
        raise ValueError(
            f"policy max_batch_size {max_batch} exceeds the model's {spec.max_batch_size}"
        )
    return ModelConfig(batching=True, max_batch_size=max_batch, batcher=pytriton_batcher(policy))


def error_response(exc: ServekitError, model: str) -> dict[str, np.ndarray]:
    """The one-request error the stub shim turns into a coded Triton error."""
    message = f"{model}: {exc}"
    return {ERROR_OUTPUT: np.array([triton_code(exc).encode(), message.encode()], dtype=object)}


def infer_callable(runner: Any, model: str) -> Callable[[list[Any]], list[dict[str, np.ndarray]]]:
    """PyTriton inference callable (not ``@batch``): one answer per request, errors included."""
    spec = runner.spec

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        inputs = [dict(r.data) for r in requests]
        return [
            error_response(result, model) if isinstance(result, ServekitError) else result
            for result in run_requests(runner, inputs, spec)
        ]

    return infer


def _shim_source() -> bytes:
    return resources.files("servekit.triton").joinpath("_stub_shim.py").read_bytes()


def install_error_shim(model_name: str) -> None:
    """Have PyTriton ship servekit's stub shim as ``model_name``'s ``model.py``.

    PyTriton copies its proxy files into each model's version folder (uploaded with the
    load request, or written to a local model store); this renames its ``model.py`` to
    ``_pytriton_model.py`` and puts the shim, which imports it, in its place.
    """
    try:
        from pytriton.models.model import Model
    except ImportError as exc:
        raise TritonSetupError(f"PyTriton's model module is missing: {exc}") from None
    if not hasattr(Model, "get_proxy_model_files") or not hasattr(Model, "generate_model"):
        raise TritonSetupError(
            "this PyTriton version lacks Model.get_proxy_model_files/generate_model; "
            "servekit supports nvidia-pytriton >= 0.5, < 0.8"
        )
    _SHIMMED.add(model_name)
    if getattr(Model, "_servekit_shim", False):
        return
    get_files, generate = Model.get_proxy_model_files, Model.generate_model

    def get_proxy_model_files(self: Any) -> dict[str, bytes]:
        files = get_files(self)
        if self.model_name in _SHIMMED:
            key = f"file:{self.model_version}/model.py"
            files[f"file:{self.model_version}/_pytriton_model.py"] = files.pop(key)
            files[key] = _shim_source()
        return files

    def generate_model(self: Any, model_repository: Path) -> None:
        generate(self, model_repository)
        if self.model_name in _SHIMMED:
            version = Path(model_repository) / self.model_name / str(self.model_version)
            (version / "model.py").rename(version / "_pytriton_model.py")
            (version / "model.py").write_bytes(_shim_source())

    Model.get_proxy_model_files = get_proxy_model_files
    Model.generate_model = generate_model
    Model._servekit_shim = True
