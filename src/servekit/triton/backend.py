"""The ``servekit`` Python-based Triton backend: what ``backend: "servekit"`` runs.

Triton loads ``backends/servekit/model.py`` (a one-line import of this module) for every
model whose config says ``backend: "servekit"``. ``parameters`` in config.pbtxt choose
what runs:

- ``kind: "runner"`` (default): ``runner`` (``onnxruntime``, ``tensorrt`` or ``torch``,
  see ``servekit.runners.load_runner``) on ``model_file`` (default ``model.onnx``) from the
  version folder, with ``precision``, ``threads`` (ONNX Runtime), ``device`` and
  ``preferred_batch_sizes`` (the TensorRT profile's ``opt``, CUDA graph sizes);
- ``kind: "preprocess"``: image bytes -> FP32 CHW (``resize``, ``crop``, ``mean``, ``std``);
- ``kind: "postprocess"``: logits -> top-k (``top_k``, ``labels_file`` in the version folder).

The config's inputs and outputs must match what servekit builds; a mismatch, a missing
or corrupt model file fails the load with a message naming it. Each request in a batch
is validated and answered on its own (``run_requests``): one bad request errors alone,
with Triton's code for it (INVALID_ARG -> HTTP 400). A batch that loses the device to a
sticky CUDA error (``batching.execute.device_lost``) is not answered: the stub exits, the
Supervisor restarts tritonserver, and servekit's front sends the batch's requests again
to the new stub, on a fresh CUDA context (``servekit.recovery``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import tracing
from ..batching.execute import as_error, device_lost, run_requests
from ..batching.sequence import SequenceFlags, SequencePolicy
from ..batching.sequencer import Row, SequenceState
from ..errors import ServekitError, triton_code, worded
from ..runners.base import Runner, batch_function, overlaps, warm_up
from ..spec import ModelSpec, spec_from_config
from ..tracing import EnvTracer
from .decoupled import DecoupledStreams
from .pipeline import DEFAULT_DEPTH, Pipeline, send_each
from .stub_metrics import FailureCounter, overlap_counter

__all__ = ["TritonPythonModel", "build_runner", "check_config"]

KINDS = ("runner", "preprocess", "postprocess", "code")
CODE_FILE = "code.json"
SEQUENCE_FLAGS = ("SERVEKIT_SEQUENCE_START", "SERVEKIT_SEQUENCE_END", "SERVEKIT_SEQUENCE_READY")
"""Control inputs tritonserver's sequence batcher gives the backend for its own use (each
request's START, END and READY), where the model declares no control of that kind."""
"""A ``code`` model's version folder: its import path, ``path`` and ``args`` (JSON)."""


def build_runner(parameters: Mapping[str, str], version_dir: Path, max_batch_size: int) -> Runner:
    """The runner or stage that ``parameters`` describe.

    Raises:
        ValueError: unknown kind or runner, bad parameter values, a missing or unreadable model file.
    """
    kind = parameters.get("kind", "runner")
    if kind not in KINDS:
        raise ValueError(f"parameter kind must be one of {list(KINDS)}, got {kind!r}")
    mbs = max(max_batch_size, 1)
    if kind == "preprocess":
        from ..stages import IMAGENET_MEAN, IMAGENET_STD, Preprocess

        return Preprocess(
            resize=_int(parameters, "resize", 256),
            crop=_int(parameters, "crop", 224),
            mean=_floats(parameters, "mean", IMAGENET_MEAN),
            std=_floats(parameters, "std", IMAGENET_STD),
            max_batch_size=mbs,
            workers=_int(parameters, "workers", 1),
        )
    if kind == "postprocess":
        from ..stages import Postprocess

        labels = parameters.get("labels_file")
        return Postprocess(
            num_classes=_int(parameters, "num_classes", 1000),
            top_k=_int(parameters, "top_k", 5),
            labels=version_dir / labels if labels else None,
            max_batch_size=mbs,
        )
    if kind == "code":
        return _code_runner(version_dir / CODE_FILE)
    path = version_dir / parameters.get("model_file", "model.onnx")
    if not path.is_file():
        raise ValueError(f"model file {path} does not exist (run `servekit repo build`)")
    from ..runners import ENGINES, load_runner

    engine = parameters.get("runner", "onnxruntime")
    if engine not in ENGINES:
        raise ValueError(f"parameter runner must be one of {list(ENGINES)}, got {engine!r}")
    preferred = parameters.get("preferred_batch_sizes", "").replace(",", " ").split()
    preferred_sizes = [
        _int({"preferred_batch_sizes": b}, "preferred_batch_sizes", 0) for b in preferred
    ]
    threads = _int(parameters, "threads", 0) or None
    try:
        return load_runner(
            path,
            engine=engine,
            precision=parameters.get("precision", "fp32"),
            max_batch_size=max_batch_size if max_batch_size else 0,
            preferred_batch_sizes=preferred_sizes,
            threads=threads,
            device=parameters.get("device"),
        )
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot load {path.name}: {type(exc).__name__}: {exc}") from None


def _code_runner(file: Path) -> Runner:
    """Your own model, imported here in the stub from what its version folder names."""
    from ..custom import import_model

    try:
        code = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{file}: {type(exc).__name__}: {exc} (run `servekit repo build`)"
        ) from None
    source = code.get("source") if isinstance(code, dict) else None
    if not isinstance(source, str):
        raise ValueError(f'{file}: no "source" (module:attribute) (run `servekit repo build`)')
    args = code.get("args") or {}
    if not isinstance(args, dict):
        raise ValueError(f'{file}: "args" must be an object, got {type(args).__name__}')
    return import_model(source, name=code.get("name", ""), path=code.get("path"), args=args)


def _int(parameters: Mapping[str, str], key: str, default: int) -> int:
    """An integer parameter, or a ``ValueError`` naming it and the value it got."""
    value = parameters.get(key)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"parameter {key}: expected an integer, got {value!r}") from None


SWITCH: dict[bool | None, str] = {None: "auto", True: "true", False: "false"}
"""A three-way setting (``[models] overlap``) as a config.pbtxt parameter, rendered by
``servekit.triton.repo`` and read back by ``_switch``."""


def _switch(parameters: Mapping[str, str], key: str) -> bool | None:
    """``true``/``false``, or None for ``auto`` (or absent): resolved as every runtime
    resolves it; anything else a ``ValueError`` naming the parameter and the value."""
    value = parameters.get(key, "")
    choices = {text: setting for setting, text in SWITCH.items()} | {"": None}
    if value not in choices:
        raise ValueError(f"parameter {key}: expected auto, true or false, got {value!r}")
    return choices[value]


def _floats(
    parameters: Mapping[str, str], key: str, default: tuple[float, ...]
) -> tuple[float, ...]:
    """Comma-separated floats, or a ``ValueError`` naming the parameter and its value."""
    value = parameters.get(key)
    if value in (None, ""):
        return default
    try:
        return tuple(float(v) for v in str(value).split(","))
    except ValueError:
        raise ValueError(
            f"parameter {key}: expected comma-separated numbers, got {value!r}"
        ) from None


def check_config(name: str, built: ModelSpec, declared: ModelSpec) -> None:
    """Raise ``ValueError`` naming the first tensor whose config differs from the runner's."""
    for kind, have, want in (
        ("input", built.inputs, declared.inputs),
        ("output", built.outputs, declared.outputs),
    ):
        by_name = {t.name: t for t in have}
        for t in want:
            if t.name not in by_name:
                raise ValueError(
                    f"{name}: config.pbtxt declares {kind} {t.name!r}, which the model does not have "
                    f"(it has {sorted(by_name)})"
                )
            got = by_name[t.name]
            dims_ok = len(got.shape) == len(t.shape) and all(
                a == b or a == -1 for a, b in zip(got.shape, t.shape, strict=True)
            )
            if got.dtype != t.dtype or not dims_ok:
                raise ValueError(
                    f"{name}: config.pbtxt {kind} {t.name!r} is {t.dtype.triton} {list(t.shape)}, "
                    f"but the model has {got.dtype.triton} {list(got.shape)}"
                )
        missing = sorted(set(by_name) - {t.name for t in want})
        if kind == "input" and missing:
            raise ValueError(f"{name}: config.pbtxt lacks the model's input(s) {missing}")


def _carrier(request: Any) -> dict[str, str] | None:
    """The trace context tritonserver hands over with ``request`` where it traces it
    (OpenTelemetry mode: a JSON object with its ``traceparent``), else None."""
    try:
        context = request.trace().get_context()
        carrier = json.loads(context) if context else None
    except Exception:  # a tritonserver without trace contexts: no span
        return None
    return carrier if isinstance(carrier, dict) and "traceparent" in carrier else None


class TritonPythonModel:
    """Triton's Python model interface, thin: parse once, then convert, run, convert back."""

    def initialize(self, args: Mapping[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        declared = spec_from_config(config)
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        self.sequence: SequenceState | None = None
        try:
            runner = build_runner(parameters, version_dir, declared.max_batch_size)
            served = runner.spec
            if parameters.get("sequence"):
                policy = SequencePolicy.from_dict(json.loads(parameters["sequence"]), "sequence")
                self.sequence = SequenceState(runner.spec, policy, self.name)
                served = self.sequence.served
                c = policy.controls
                self.flags = tuple(
                    mine or ours
                    for mine, ours in zip((c.start, c.end, c.ready), SEQUENCE_FLAGS, strict=True)
                )
            check_config(self.name, served, declared)
            self.runner = runner
            self.spec = declared
            warm_up(runner, self.name)
        except Exception as exc:
            raise pb_utils.TritonModelException(f"servekit backend: {self.name}: {exc}") from None
        self.failures = FailureCounter(pb_utils, self.name, str(args["model_version"]))
        self.inputs = [t.name for t in declared.inputs]
        self.outputs = [t.name for t in declared.outputs]
        self.streams: DecoupledStreams | None = None
        if getattr(runner, "decoupled", False):
            if not pb_utils.using_decoupled_model_transaction_policy(config):
                raise pb_utils.TritonModelException(
                    f"servekit backend: {self.name}: the model is decoupled; its config.pbtxt "
                    "needs model_transaction_policy { decoupled: true } (servekit repo build)"
                )
            self.streams = DecoupledStreams(pb_utils, runner, self.name, self.outputs)
        self.tracer = EnvTracer.from_env("servekit-backend")
        """Spans of the requests tritonserver traces, where ``OTEL_EXPORTER_OTLP_TRACES_
        ENDPOINT`` is set (the triton runtime sets it with ``[server.tracing]``)."""
        depth = _int(parameters, "pipeline", DEFAULT_DEPTH)
        ahead = overlaps(_switch(parameters, "overlap"), runner)
        plain = self.sequence is None and self.streams is None
        self.pipeline = (
            Pipeline(
                self._run,
                self._send,
                depth,
                ahead=ahead,
                size=self._rows,
                overlapped=overlap_counter(pb_utils, self.name, str(args["model_version"])),
            )  # fmt: skip
            if (ahead or depth > 1) and plain
            else None
        )
        pb_utils.Logger.log_info(
            f"servekit: {self.name} v{args['model_version']} ready "
            f"({parameters.get('kind', 'runner')}, max_batch_size {declared.max_batch_size})"
        )

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.sequence is not None:
            return self._sequence(requests)
        pb = self._pb
        if self.streams is not None:  # decoupled: answered through each request's sender
            for r in requests:
                tensors = {n: pb.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs}
                self.streams.answer(r, tensors)
            return None
        # Pipelined, copies: a request's tensors are Triton's to free once execute returns.
        read = np.array if self.pipeline is not None else (lambda a: a)
        tracer = self.tracer
        items = [
            (
                {n: read(pb.get_input_tensor_by_name(r, n).as_numpy()) for n in self.inputs},
                _carrier(r) if tracer is not None else None,
            )
            for r in requests
        ]
        if self.pipeline is None:
            return self._responses(self._run(items))
        self.pipeline.submit(items, [r.get_response_sender() for r in requests])
        return None  # answered through the senders (``pipeline``)

    def _rows(self, items: list[tuple[dict[str, np.ndarray], Any]]) -> int:
        """A batch's rows (its requests' where the model does not batch)."""
        if self.spec.max_batch_size > 0 and self.inputs:
            return sum(len(x[self.inputs[0]]) for x, _ in items)
        return len(items)

    def _run(self, items: list[tuple[dict[str, np.ndarray], Any]]) -> list[Any]:
        """Each request's result: its tensors run with the batch's, and where tritonserver
        traces it (its carrier), a span of the run (``_traced``)."""
        inputs = [x for x, _ in items]
        carriers = [c for _, c in items]
        if self.tracer is None or all(c is None for c in carriers):
            results = run_requests(self.runner, inputs, self.runner.spec, name=self.name)
        else:
            results = self._traced(carriers, items, self.tracer)
        lost = device_lost(self.runner)
        if lost:  # every later CUDA call of this process fails: a new stub serves again
            self._pb.Logger.log_error(
                f"servekit: {self.name}: {lost}; the stub exits for a new one to serve"
            )
            os._exit(70)
        return results

    def _traced(
        self, carriers: list[Any], items: list[tuple[dict[str, np.ndarray], Any]], tracer: EnvTracer
    ) -> list[Any]:
        """The batch's results, with a span per request tritonserver traces (``servekit
        backend``: the batch's run, its rows, the request's error), under tritonserver's
        own span of it; a pipeline runner's steps as the span's children."""
        inputs = [x for x, _ in items]
        parents = [c["traceparent"] for c in carriers if c is not None]
        start = time.monotonic()
        with tracing.recording(parents) as batch:
            results = run_requests(self.runner, inputs, self.runner.spec, name=self.name)
        end = time.monotonic()
        rows = self._rows(items)
        for carrier, result in zip(carriers, results, strict=True):
            if carrier is None:
                continue
            error = result if isinstance(result, BaseException) else None
            span = tracer.span("servekit backend", carrier, start, end, error,
                               model=self.name, batch_rows=rows, requests=len(items))  # fmt: skip
            tracing.step_spans(span, tracer.tracer, batch.steps)
        return results

    def _send(self, senders: list[Any], results: Sequence[Any]) -> None:
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        responses = self._responses(results)
        send_each(senders, responses, lambda s, r: s.send(r, flags=final))

    def _responses(self, results: Sequence[Any]) -> list[Any]:
        """A batch's responses; an error beside answers is counted as isolated."""
        failed = sum(isinstance(r, BaseException) for r in results)
        isolated = 0 < failed < len(results)
        return [self._response(result, isolated) for result in results]

    def _response(self, result: Any, isolated: bool = False) -> Any:
        """One request's response: its outputs, or its error with Triton's code for it."""
        pb = self._pb
        if isinstance(result, BaseException):
            error = result if isinstance(result, ServekitError) else as_error(result, self.name)
            self.failures.count(triton_code(error), isolated)
            code = getattr(pb.TritonError, triton_code(error), pb.TritonError.INTERNAL)
            return pb.InferenceResponse(error=pb.TritonError(worded(error, self.name), code))
        tensors = [pb.Tensor(n, np.ascontiguousarray(result[n])) for n in self.outputs]
        return pb.InferenceResponse(output_tensors=tensors)

    def _sequence(self, requests: list[Any]) -> list[Any]:
        """A batch tritonserver's sequence batcher formed (one request per sequence, a
        null one READY 0 in a held slot): servekit's control values and implicit state
        (``SequenceState``), one run, each request's served outputs."""
        pb, state = self._pb, self.sequence
        assert state is not None
        rows: list[Row] = []
        for r in requests:
            start, end, ready = (
                bool(pb.get_input_tensor_by_name(r, n).as_numpy().reshape(-1)[0])
                for n in self.flags
            )
            if not ready:
                rows.append(None)
                continue
            flags = SequenceFlags(r.correlation_id(), start, end)
            rows.append(
                (flags, {n: pb.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs})
            )
        try:
            outputs = batch_function(self.runner)(state.inputs(rows))
            self.runner.spec.check_outputs(outputs, len(rows))
            answers = state.outputs(rows, outputs)
        except Exception as exc:
            error = as_error(exc, self.name)
            self.failures.count(triton_code(error))
            code = getattr(pb.TritonError, triton_code(error), pb.TritonError.INTERNAL)
            return [
                pb.InferenceResponse(error=pb.TritonError(worded(error, self.name), code))
                for _ in requests
            ]
        responses = []
        for answer in answers:
            if answer is None:  # a held slot with nothing to run: Triton drops its response
                answer = {
                    t.name: np.zeros((1, *t.shape), t.dtype.numpy) for t in state.served.outputs
                }
            tensors = [pb.Tensor(n, np.ascontiguousarray(answer[n])) for n in self.outputs]
            responses.append(pb.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self) -> None:
        tracer = getattr(self, "tracer", None)
        if tracer is not None:
            tracer.shutdown()
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
