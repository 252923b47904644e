"""Runs inside Triton's Python backend stub, in place of PyTriton's proxy ``model.py``.

PyTriton fails every request of a batch with one INTERNAL error. This wraps its
proxy so a response carrying ``__servekit_error__`` (code, message) becomes an
error response for that request alone, with the right code (INVALID_ARG -> HTTP
400 / gRPC INVALID_ARGUMENT, UNAVAILABLE -> 503, ...). servekit installs it as
``model.py`` next to PyTriton's proxy, renamed ``_pytriton_model.py``. It also makes
the second and later instances of a model wait for the first one's handshake instead
of failing the load (``_get_config_patiently``).
"""

import json
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from . import _pytriton_model as _proxy  # type: ignore[attr-defined]

ERROR_OUTPUT = "__servekit_error__"
_wrap_response = _proxy._wrap_response
_failures = None  # servekit's FailureCounter, made in initialize (one model per stub)


RAN_OUTPUT = "__servekit_ran__"
_ran = None  # the last answered batch's (start, end) in the infer function's process (time.time)


def _wrap_response_or_error(response, requested_output_names, model_outputs_dict):  # type: ignore[no-untyped-def]
    global _ran
    data = response.data
    if data is not None and RAN_OUTPUT in data:
        _ran = tuple(float(t) for t in data.pop(RAN_OUTPUT))
    if data is not None and ERROR_OUTPUT in data:
        fields = [v.decode("utf-8", "replace") for v in data[ERROR_OUTPUT].reshape(-1)]
        code, message = fields[:2]
        if _failures is not None:
            _failures.count(code, len(fields) > 2 and fields[2] == "isolated")
        error_code = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, error_code))
    return _wrap_response(response, requested_output_names, model_outputs_dict)


class _Answered:
    """A request as PyTriton's response handler reads it once ``execute`` has returned:
    its requested outputs, taken while the request was Triton's to read."""

    def __init__(self, request):  # type: ignore[no-untyped-def]
        self._names = list(request.requested_output_names())

    def requested_output_names(self):  # type: ignore[no-untyped-def]
        return self._names


class TritonPythonModel(_proxy.TritonPythonModel):  # type: ignore[misc,name-defined]
    def initialize(self, args):  # type: ignore[no-untyped-def]
        global _failures
        pipeline = None
        try:
            from servekit.triton.pipeline import DEFAULT_DEPTH, Pipeline
            from servekit.triton.stub_metrics import FailureCounter, overlap_counter

            _failures = FailureCounter(pb_utils, args["model_name"], str(args["model_version"]))
            overlaps = overlap_counter(pb_utils, args["model_name"], str(args["model_version"]))
        except ImportError:  # servekit not importable by this stub: no counter, no pipeline
            _failures, DEFAULT_DEPTH = None, 1
        super().initialize(args)
        known = all(  # the proxy's parts the pipeline relies on (PyTriton 0.5 to 0.7)
            hasattr(self, a) for a in ("_requests", "_requests_server", "_tracable_model")
        )
        options = Path(__file__).with_name("servekit.json")  # written by servekit's binding
        ahead = options.exists() and json.loads(options.read_text()).get("overlap", False)
        if (ahead or DEFAULT_DEPTH > 1) and known and not self._decoupled_model:
            size = lambda batches: sum(b[3] for b in batches)  # noqa: E731  # rows
            pipeline = Pipeline(
                self._answers_of, self._send, DEFAULT_DEPTH, ahead=ahead, size=size,
                overlapped=overlaps,
            )  # fmt: skip
        self._pipeline = pipeline

    def execute(self, triton_requests):  # type: ignore[no-untyped-def]
        """PyTriton's execute; pipelined (``servekit.triton.pipeline``), it returns once
        the batch is on its way to the infer function, so the next batch is handed over
        while this one runs, and each response goes back through its request's response
        sender."""
        if self._pipeline is None:
            return super().execute(triton_requests)
        spans = self._tracable_model.start_requests_spans(triton_requests)
        self._next_id = (getattr(self, "_next_id", 0) + 1) % 2**32
        requests_id = self._next_id.to_bytes(4, "big")
        while requests_id in self._requests:
            self._next_id = (self._next_id + 1) % 2**32
            requests_id = self._next_id.to_bytes(4, "big")
        self._requests[requests_id] = [_Answered(r) for r in triton_requests]
        senders = [r.get_response_sender() for r in triton_requests]
        # Returns once the inputs are serialized and sent: the requests are not read after.
        answers = self._requests_server.push(requests_id, triton_requests, spans).result()
        self._pipeline.submit([(answers, spans, len(senders), _rows(triton_requests))], senders)
        return None

    def _answers_of(self, batches):  # type: ignore[no-untyped-def]
        """Each batch's responses once the infer function has answered (the pipeline's
        ``run``): PyTriton's, or its error for every request of the batch."""
        global _ran
        out = []
        for answers, spans, count, _ in batches:
            result = answers.result()
            ran, _ran = _ran, None  # the infer function's own times, for the pipeline's lead
            if ran is not None:
                shift = time.monotonic() - time.time()
                self._pipeline.ran(ran[0] + shift, ran[1] + shift)
            self._tracable_model.end_requests_spans(spans, result)
            if isinstance(result, Exception):
                result = [result] * count
            out.extend(result)
        return out

    def _send(self, senders, responses):  # type: ignore[no-untyped-def]
        from servekit.triton.pipeline import send_each

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def send(sender, response):  # type: ignore[no-untyped-def]
            if isinstance(response, BaseException):
                error = pb_utils.TritonError(f"Model execute error: {response}")
                response = pb_utils.InferenceResponse(error=error)
            sender.send(response, flags=final)

        send_each(senders, responses, send)

    def finalize(self):  # type: ignore[no-untyped-def]
        if self._pipeline is not None:
            self._pipeline.close()
        return super().finalize()


def _rows(triton_requests):  # type: ignore[no-untyped-def]
    """A batch's rows: each request's first input's first dimension (or one each)."""
    try:
        return sum(int(r.inputs()[0].shape()[0]) for r in triton_requests)
    except Exception:  # no inputs, or a model without a batch dimension
        return len(triton_requests)


_get_config = _proxy.get_config_from_handshake_server


def _get_config_patiently(socket_path, timeout_s=1.0):  # type: ignore[no-untyped-def]
    """PyTriton's instances after the first read their config from the first one's
    handshake socket with a 1 s deadline and no retry; on a busy machine the socket's
    file exists a moment before it listens, the connection is refused and the model
    fails to load. Keep asking for up to 60 s instead."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return _get_config(socket_path, timeout_s=5.0)
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


_proxy._wrap_response = _wrap_response_or_error
_proxy.get_config_from_handshake_server = _get_config_patiently
