"""servekit models on PyTriton: the spec and policy rendered to PyTriton, and the infer callable.

Triton's C++ dynamic batcher forms the batches (``BatchingPolicy.to_pytriton``);
each batch reaches ``infer_callable``, which validates every request, runs the valid
ones together and answers each request on its own (``batching.run_requests``). A
request that fails alone gets its own error with the right code through the stub
shim (``_stub_shim.py``), instead of PyTriton's one INTERNAL error for the batch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .. import tracing
from ..batching.execute import run_requests
from ..errors import ServekitError, triton_code, worded
from ..runners.simulated import HANDED
from ..spec import TensorSpec
from ..triton.env import TritonSetupError

__all__ = [
    "ERROR_OUTPUT",
    "error_response",
    "infer_callable",
    "install_error_shim",
    "install_parameters",
    "pytriton_tensors",
]

ERROR_OUTPUT = "__servekit_error__"
"""Pseudo-output that carries (code, message) for one request to the stub shim."""
RAN_OUTPUT = "__servekit_ran__"
"""Pseudo-output on one answer of a batch: when the batch started and ended (``time.time``),
for the stub shim's pipeline, which cannot see it run in this process."""

_SHIMMED: dict[str, bytes] = {}
"""Each shimmed model's options for the shim (``servekit.json`` beside its ``model.py``)."""
OPTIONS_FILE = "servekit.json"
_PARAMETERS: dict[str, dict[str, str]] = {}
"""Each model's own ``parameters`` for its Triton model configuration (``install_parameters``)."""


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


def error_response(exc: ServekitError, model: str, isolated: bool = False) -> dict[str, np.ndarray]:
    """The one-request error the stub shim turns into a coded Triton error (``isolated``:
    the rest of its batch was answered, counted so in the stub)."""
    message = worded(exc, model)
    flags = b"isolated" if isolated else b""
    return {
        ERROR_OUTPUT: np.array([triton_code(exc).encode(), message.encode(), flags], dtype=object)
    }


def infer_callable(
    runner: Any, model: str, tracer: tracing.Tracing | None = None, *, overlap: bool = False
) -> Callable[[list[Any]], Any]:
    """PyTriton inference callable (not ``@batch``): one answer per request, errors
    included; with ``tracer``, a pipeline's steps as spans of each traced request.

    With ``overlap`` (the stub hands the next batch over while one runs) it is a
    coroutine that runs each batch on a thread of its own, one batch at a time: PyTriton
    runs a callable on its handler's event loop, so a plain one would keep the next
    batch, already handed over, waiting there while the last one's answers go back."""
    spec = runner.spec

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        inputs = [dict(r.data) for r in requests]
        # PyTriton's span of each traced request: a pipeline's steps become its children,
        # sent by servekit's exporter (PyTriton's tracer is one per process, set once).
        spans = (
            [span for r in requests if (span := getattr(r, "span", None)) is not None]
            if tracer is not None
            else []
        )
        if not spans or tracer is None:
            results = run_requests(runner, inputs, spec, name=model)
        else:
            with tracing.recording([]) as trace:
                results = run_requests(runner, inputs, spec, name=model)
            for span in spans:
                tracing.step_spans(span, tracer.tracer, trace.steps)
        failed = sum(isinstance(r, ServekitError) for r in results)
        isolated = 0 < failed < len(results)
        return [
            error_response(result, model, isolated) if isinstance(result, ServekitError) else result
            for result in results
        ]

    if not overlap:
        return infer
    device = ThreadPoolExecutor(1, thread_name_prefix=f"servekit-{model}")

    def infer_timed(requests: list[Any], handed: float) -> list[dict[str, np.ndarray]]:
        start = time.time()
        token = HANDED.set(handed)
        try:
            answers = infer(requests)
        finally:
            HANDED.reset(token)
        ran = np.array([start, time.time()])
        for i, answer in enumerate(answers):  # the stub shim's pipeline reads and drops it
            if ERROR_OUTPUT not in answer:
                answers[i] = {**answer, RAN_OUTPUT: ran}
                break
        return answers

    async def infer_on_device_thread(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(device, infer_timed, requests, time.time())

    return infer_on_device_thread


def _shim_source() -> bytes:
    return resources.files("servekit.pytriton").joinpath("_stub_shim.py").read_bytes()


def install_error_shim(model_name: str, *, overlap: bool = False) -> None:
    """Have PyTriton ship servekit's stub shim as ``model_name``'s ``model.py``.

    PyTriton copies its proxy files into each model's version folder (uploaded with the
    load request, or written to a local model store); this renames its ``model.py`` to
    ``_pytriton_model.py`` and puts the shim, which imports it, in its place, with the
    model's options beside it (``overlap``: ``servekit.triton.pipeline``'s ``ahead``).
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
    _SHIMMED[model_name] = json.dumps({"overlap": overlap}).encode()
    if getattr(Model, "_servekit_shim", False):
        return
    get_files, generate = Model.get_proxy_model_files, Model.generate_model

    def get_proxy_model_files(self: Any) -> dict[str, bytes]:
        files = get_files(self)
        if self.model_name in _SHIMMED:
            key = f"file:{self.model_version}/model.py"
            files[f"file:{self.model_version}/_pytriton_model.py"] = files.pop(key)
            files[key] = _shim_source()
            files[f"file:{self.model_version}/{OPTIONS_FILE}"] = _SHIMMED[self.model_name]
        return files

    def generate_model(self: Any, model_repository: Path) -> None:
        generate(self, model_repository)
        if self.model_name in _SHIMMED:
            version = Path(model_repository) / self.model_name / str(self.model_version)
            (version / "model.py").rename(version / "_pytriton_model.py")
            (version / "model.py").write_bytes(_shim_source())
            (version / OPTIONS_FILE).write_bytes(_SHIMMED[self.model_name])

    Model.get_proxy_model_files = get_proxy_model_files
    Model.generate_model = generate_model
    Model._servekit_shim = True


def install_parameters(model_name: str, parameters: Mapping[str, str]) -> None:
    """Have PyTriton write ``parameters`` into ``model_name``'s Triton model configuration
    beside its own (``parameters`` of config.pbtxt, which ``/v2/models/<m>/config`` shows):
    PyTriton's ``ModelConfig`` has no field for them. Empty: none (a model bound before
    under the name keeps none of its own)."""
    try:
        from pytriton.models.model import Model
    except ImportError as exc:
        raise TritonSetupError(f"PyTriton's model module is missing: {exc}") from None
    if not hasattr(Model, "_get_triton_model_config"):
        raise TritonSetupError(
            "this PyTriton version lacks Model._get_triton_model_config; "
            "servekit supports nvidia-pytriton >= 0.5, < 0.8"
        )
    _PARAMETERS[model_name] = dict(parameters)
    if getattr(Model, "_servekit_parameters", False):
        return
    rendered = Model._get_triton_model_config

    def _get_triton_model_config(self: Any) -> Any:
        config = rendered(self)
        config.backend_parameters.update(_PARAMETERS.get(self.model_name, {}))
        return config

    Model._get_triton_model_config = _get_triton_model_config
    Model._servekit_parameters = True
