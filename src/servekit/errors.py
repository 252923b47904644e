"""servekit's exception tree, and the one place it maps to protocol status codes.

::

    ServekitError
    ├── InvalidInput          the request is wrong: HTTP 400, gRPC INVALID_ARGUMENT
    │   ├── PayloadTooLarge   the body is over the size limit: HTTP 413, gRPC RESOURCE_EXHAUSTED
    │   ├── PoisonInput       its worker died with this input in flight twice: not sent again
    │   └── UnsupportedEncoding  a Content-Encoding the server cannot decode: HTTP 415, gRPC UNIMPLEMENTED
    ├── Unauthenticated       the access token is missing or wrong: HTTP 401, gRPC UNAUTHENTICATED
    ├── ModelNotFound         no such model or version: HTTP 404, gRPC NOT_FOUND
    ├── RegionNotFound        no such shared-memory region registered: HTTP 404, gRPC NOT_FOUND
    ├── ModelNotReady         loading, unloading or closed: HTTP 503, gRPC UNAVAILABLE
    │   ├── FetchFailed       its file could not be fetched from object storage (why, where)
    │   └── ModelBroken       no instance can serve (the model reads not ready, with why)
    │       ├── SetupFailed   its set-up (constructor, ``setup``) raised
    │       └── DeviceLost    a sticky CUDA error: the process's device is lost
    ├── Overloaded            queue full, retry later: HTTP 503, gRPC UNAVAILABLE
    ├── DeadlineExceeded      the request's timeout passed before it ran: HTTP 504, gRPC DEADLINE_EXCEEDED
    │   └── WorkerDied        its worker died and none answered it before its deadline
    ├── UpdateRefused         a new version cannot replace the serving one: HTTP 400, gRPC FAILED_PRECONDITION
    ├── RunnerError           the model itself failed: HTTP 500, gRPC INTERNAL
    └── SetupError            the server cannot start (never a request's answer)
        └── TritonSetupError  something tritonserver needs is missing

Core code raises these; only adapters (HTTP front, PyTriton, Triton backend, Ray)
turn them into status codes, through :func:`http_status`, :func:`grpc_code` and
:func:`triton_code` (the Python backend's ``TritonError`` code, which Triton maps
to the same HTTP and gRPC statuses).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CONTROL_TOKEN_HEADER",
    "DeadlineExceeded",
    "FetchFailed",
    "INFERENCE_TOKEN_HEADER",
    "PYTRITON_TOKEN_HEADER",
    "InvalidInput",
    "DeviceLost",
    "ModelBroken",
    "ModelNotFound",
    "ModelNotReady",
    "RegionNotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PoisonInput",
    "RunnerError",
    "ServekitError",
    "SetupError",
    "SetupFailed",
    "Shed",
    "TritonSetupError",
    "Unauthenticated",
    "UnsupportedEncoding",
    "UpdateRefused",
    "WorkerDied",
    "from_grpc_code",
    "from_http_status",
    "grpc_code",
    "http_status",
    "triton_code",
    "worded",
]


INFERENCE_TOKEN_HEADER = "servekit-inference-token"
"""Header (HTTP) or metadata key (gRPC) carrying the inference access token."""
CONTROL_TOKEN_HEADER = "servekit-control-token"
"""Header carrying the model-control token (Triton's repository and shared-memory APIs)."""
PYTRITON_TOKEN_HEADER = "triton-access-token"
"""Where PyTriton's tritonserver reads the token of its restricted APIs."""
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
"""Where Triton reads a restricted gRPC protocol's header: metadata key = prefix + header."""


class ServekitError(Exception):
    """Base of every error servekit raises on purpose."""


class InvalidInput(ServekitError, ValueError):
    """A request does not match the model's signature (name, dtype, shape, batch) or cannot be decoded."""


class ModelNotFound(ServekitError, LookupError):
    """The requested model or version does not exist."""


class RegionNotFound(ServekitError, LookupError):
    """A request names a shared-memory region nobody registered (Triton's 404)."""


class ModelNotReady(ServekitError):
    """The model exists but cannot take requests now (loading, draining or closed)."""


class FetchFailed(ModelNotReady):
    """A model file could not be fetched from object storage; the message names the object
    (bucket, key) and the error. Nothing half-written is left, and a serving version stays."""


class ModelBroken(ModelNotReady):
    """No instance of the model can serve: the model reads not ready, and the repository
    index gives this error's words as its reason. A 503 a client may retry elsewhere."""


class SetupFailed(ModelBroken, ValueError):
    """Your own model's set-up (its constructor, ``setup``) raised. ``spec`` is the
    signature the model declares (None for a Runner, which has one only once built): with
    it the model is served not ready instead of refusing the server's start."""

    def __init__(self, message: str, spec: object = None) -> None:
        super().__init__(message)
        self.spec = spec


class DeviceLost(ModelBroken):
    """A sticky CUDA error (an illegal address, a device-side assert: ``cuda.is_sticky``):
    every later call on the process's device fails, so the batch is not bisected, the
    instance is broken and only a new process serves again (``docs/operations.md``)."""


class ServerUnreachable(ModelNotReady):
    """The client could not reach the server at all (connection refused or reset, no such
    host): nothing answered, so no model's state is known. A client-side error."""


class Overloaded(ServekitError):
    """The queue is full; the request was rejected at once so memory stays bounded.

    ``retry_after_s`` is a hint for clients (HTTP ``Retry-After``).
    """

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Shed(Overloaded):
    """Refused at admission because the queue's measured pace would answer it after its
    deadline (``shed_late``): refused unrun instead of queued to fail late."""


class DeadlineExceeded(ServekitError, TimeoutError):
    """The request's timeout passed before it could run; it was dropped unexecuted."""


class WorkerDied(DeadlineExceeded):
    """The worker running the request died and no live one answered it before its
    deadline (``servekit.recovery``)."""


class PoisonInput(InvalidInput):
    """A worker died with this input in flight too often: it is not sent again, and the
    same input is refused at once (a 4xx, so no client or proxy retries it elsewhere)."""


class Unauthenticated(ServekitError, PermissionError):
    """The request lacks the access token this endpoint needs, or carries a wrong one."""


class RunnerError(ServekitError, RuntimeError):
    """The model (runner or stage) raised or returned outputs that break its signature."""


class PayloadTooLarge(InvalidInput):
    """A request body (or its decompressed form) over the server's size limit."""

    def __init__(self, size: int, limit: int, what: str = "request body") -> None:
        super().__init__(f"{what} of {size} bytes exceeds the limit of {limit}")


class UnsupportedEncoding(InvalidInput):
    """A Content-Encoding (or gRPC message encoding) the server cannot decode."""


class UpdateRefused(ServekitError, ValueError):
    """The new version cannot replace the serving one (its signature differs)."""


class SetupError(ServekitError, RuntimeError):
    """Something a server needs to start is missing; the message says what and how to get it."""


class TritonSetupError(SetupError):
    """Something Triton needs is missing; the message says what and how to get it."""


_HTTP = {
    PayloadTooLarge: 413,
    UnsupportedEncoding: 415,
    UpdateRefused: 400,
    InvalidInput: 400,
    ModelNotFound: 404,
    RegionNotFound: 404,
    ModelNotReady: 503,
    Overloaded: 503,
    DeadlineExceeded: 504,
    Unauthenticated: 401,
    RunnerError: 500,
}

_GRPC = {
    PayloadTooLarge: "RESOURCE_EXHAUSTED",
    UnsupportedEncoding: "UNIMPLEMENTED",
    UpdateRefused: "FAILED_PRECONDITION",
    InvalidInput: "INVALID_ARGUMENT",
    ModelNotFound: "NOT_FOUND",
    RegionNotFound: "NOT_FOUND",
    ModelNotReady: "UNAVAILABLE",
    Overloaded: "UNAVAILABLE",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    Unauthenticated: "UNAUTHENTICATED",
    RunnerError: "INTERNAL",
}


_TRITON = {
    UpdateRefused: "INVALID_ARG",
    InvalidInput: "INVALID_ARG",
    ModelNotFound: "NOT_FOUND",
    RegionNotFound: "NOT_FOUND",
    ModelNotReady: "UNAVAILABLE",
    Overloaded: "UNAVAILABLE",
    DeadlineExceeded: "UNAVAILABLE",  # the Python backend has no deadline code
    Unauthenticated: "INVALID_ARG",  # nor an authentication one; Triton checks tokens itself
    RunnerError: "INTERNAL",
}


def _lookup(table: Mapping[type, object], exc: BaseException, default: object) -> object:
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return default


def http_status(exc: BaseException) -> int:
    """HTTP status for an exception; anything not a ServekitError is a 500."""
    return int(_lookup(_HTTP, exc, 500))  # type: ignore[call-overload]


def grpc_code(exc: BaseException) -> str:
    """gRPC status code name (``grpc.StatusCode`` member name) for an exception."""
    return str(_lookup(_GRPC, exc, "INTERNAL"))


def worded(exc: BaseException, model: str) -> str:
    """What a client reads of ``exc`` from model ``model``, on every runtime: the model
    named once (a model's own failure names it already: ``model m: ValueError: ...``)."""
    text = str(exc)
    return text if text.startswith((f"{model}: ", f"model {model}: ")) else f"{model}: {text}"


def triton_code(exc: BaseException) -> str:
    """``TritonError`` code name (``INVALID_ARG``, ``UNAVAILABLE``, ...) for an exception."""
    return str(_lookup(_TRITON, exc, "INTERNAL"))


_FROM_HTTP: dict[int, type[ServekitError]] = {
    400: InvalidInput,
    401: Unauthenticated,
    403: Unauthenticated,  # Triton's answer on a restricted API without its header
    404: ModelNotFound,
    503: ModelNotReady,
    504: DeadlineExceeded,
}
_FROM_GRPC: dict[str, type[ServekitError]] = {
    "INVALID_ARGUMENT": InvalidInput,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": Unauthenticated,
    "NOT_FOUND": ModelNotFound,
    "UNAVAILABLE": ModelNotReady,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}


def from_http_status(status: int, message: str) -> ServekitError:
    """The servekit error a remote HTTP status stands for (clients raise these)."""
    if status == 503 and "queue" in message.lower():
        return Overloaded(message)
    return _FROM_HTTP.get(status, RunnerError)(message)


def from_grpc_code(code: str, message: str) -> ServekitError:
    """The servekit error a remote gRPC status code name stands for."""
    code = code.removeprefix("StatusCode.")
    if code == "UNAVAILABLE" and "restricted, expecting header" in message:
        return Unauthenticated(message)  # Triton's answer on a restricted gRPC protocol
    if code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED") and "queue" in message.lower():
        return Overloaded(message)
    return _FROM_GRPC.get(code, RunnerError)(message)
