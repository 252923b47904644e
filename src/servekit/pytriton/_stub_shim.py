"""Runs inside Triton's Python backend stub, in place of PyTriton's proxy ``model.py``.

PyTriton fails every request of a batch with one INTERNAL error. This wraps its
proxy so a response carrying ``__servekit_error__`` (code, message) becomes an
error response for that request alone, with the right code (INVALID_ARG -> HTTP
400 / gRPC INVALID_ARGUMENT, UNAVAILABLE -> 503, ...). servekit installs it as
``model.py`` next to PyTriton's proxy, renamed ``_pytriton_model.py``. It also makes
the second and later instances of a model wait for the first one's handshake instead
of failing the load (``_get_config_patiently``).
"""

import time

import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

from . import _pytriton_model as _proxy  # type: ignore[attr-defined]

ERROR_OUTPUT = "__servekit_error__"
_wrap_response = _proxy._wrap_response
_failures = None  # servekit's FailureCounter, made in initialize (one model per stub)


def _wrap_response_or_error(response, requested_output_names, model_outputs_dict):  # type: ignore[no-untyped-def]
    data = response.data
    if data is not None and ERROR_OUTPUT in data:
        code, message = (v.decode("utf-8", "replace") for v in data[ERROR_OUTPUT].reshape(-1)[:2])
        if _failures is not None:
            _failures.count(code)
        error_code = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, error_code))
    return _wrap_response(response, requested_output_names, model_outputs_dict)


class TritonPythonModel(_proxy.TritonPythonModel):  # type: ignore[misc,name-defined]
    def initialize(self, args):  # type: ignore[no-untyped-def]
        global _failures
        try:
            from servekit.triton.stub_metrics import FailureCounter

            _failures = FailureCounter(pb_utils, args["model_name"], str(args["model_version"]))
        except ImportError:  # servekit not importable by this stub: no failure counter
            _failures = None
        return super().initialize(args)


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
