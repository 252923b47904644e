"""A KServe v2 HTTP front for servekit models: one request handler every runtime sits behind.

``KServeApp.handle`` answers one request (method, path, headers, body); servekit's own
HTTP/1.1 server (``h1``) calls it directly. The app is also an ASGI app, an adapter over
``handle``, for any ASGI server (``serve_http`` uses uvicorn) and the Ray Serve ingress. Models are Runners (called on a thread) or ``Batcher``s (awaited), so the same
front gives dynamic batching in-process. Errors map once through ``errors.http_status``:
bad requests are 400 naming the tensor, unknown models 404, a full queue 503 with
``Retry-After``; an unexpected exception is a 500 for that request and never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, cast

from ..batching import Batcher
from ..batching.sequencer import SequenceBatcher
from ..compression import ENCODINGS, inflate
from ..config import MAX_BODY_BYTES
from ..errors import (
    CONTROL_TOKEN_HEADER,
    INFERENCE_TOKEN_HEADER,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RunnerError,
    ServekitError,
    Unauthenticated,
    UnsupportedEncoding,
    http_status,
)
from ..metrics import CONTENT_TYPE, Metrics
from ..protocol.kserve import (
    HEADER_LENGTH,
    DecodedRequest,
    decode_request,
    encode_response,
    metadata,
    parse_json,
    raw_binary_request,
)
from ..protocol.models import (
    Decoupled,
    DecoupledModel,
    FrontModel,
    ModelRegistry,
    PassThrough,
    PassThroughRegistry,
    RepositoryControl,
    as_registry,
    conforms,
    decoupled_figures,
    input_device,
    lost_device,
)
from ..protocol.parameters import scheduling, sequence_flags
from ..protocol.routed import RoutedModel, infer_answered
from ..protocol.shm import Regions, SharedMemory
from ..protocol.surface import (
    NOT_SERVED,
    model_config_json,
    ready_only_asked,
    repository_index,
    server_metadata,
    statistics,
)
from ..tracing import Tracing
from .asgi import serve_asgi
from .events import event_stream
from .forward import MODEL, Forwarding, whole_body
from .messages import Answer, Handler, HttpRequest, not_allowed
from .sharedmemory import SHARED_MEMORY, shared_memory_answer
from .trace import TRACE_SETTING, trace_setting

__all__ = ["KServeApp", "metrics_handler"]

log = logging.getLogger(__name__)

_NOT_SERVED = re.compile(r"^/v2/(repository/models/|trace|logging)")
_REPOSITORY_MODEL = re.compile(r"^/v2/repository/models/(?P<name>.+)/(?P<action>load|unload)$")
"""A load or unload; any name, so that one with a ``/`` in it (``..%2Fetc``) is an unknown
model, not a path no route serves."""
ROUTES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("GET", re.compile(r"^/v2/health/live$"), "_live"),
    ("GET", re.compile(r"^/v2/health/ready$"), "_server_ready"),
    ("GET", re.compile(r"^/metrics$"), "_metrics"),
    ("GET", re.compile(r"^/v2$"), "_server_metadata"),
    ("POST", re.compile(r"^/v2/repository/index$"), "_index"),
    ("GET", re.compile(r"^/v2/models/stats$"), "_all_stats"),
    ("*", SHARED_MEMORY, "_shared_memory"),
    ("POST", _REPOSITORY_MODEL, "_repository_model"),
    ("*", TRACE_SETTING, "_trace_setting"),
    ("*", _NOT_SERVED, "_not_served"),
    ("*", MODEL, "_model"),
)
"""(method, or * for any; path pattern; ``KServeApp`` handler) in the order they are
tried: the first whose method and path match answers; a path matched only with other
methods is a 405, one none matches a 404."""
_JSON = {"content-type": "application/json"}
_MODEL_METHODS = {None: "GET", "/ready": "GET", "/config": "GET", "/stats": "GET", "/infer": "POST"}
"""The method each of a model's paths takes (``/traffic``: GET and POST, its own)."""


class KServeApp(Forwarding):
    """ASGI app: ``/v2/health/{live,ready}``, ``/v2``,
    ``/v2/models/{name}[/versions/{v}][/ready|/infer|/config|/stats]``, ``/v2/models/stats``,
    ``/v2/repository/index`` (``servekit.protocol.surface``) and Triton's system shared
    memory (with ``shared_memory``, or passed to tritonserver by the front; ``ROUTES``);
    Triton's other control APIs are a 403 saying where they are served.

    ``GET /metrics`` is the Prometheus exposition (Triton's ``nv_inference_*`` names) for
    every model with a Batcher behind it.

    Args:
        models: name -> Runner (run on a worker thread), Batcher (awaited) or ``FrontModel``;
            or a ``ModelRegistry`` that finds models as they come and go and answers their
            readiness (``front.TritonModels``). See ``servekit.protocol.models``.
        max_body_bytes: larger request bodies are refused with 413 before they are read whole.
        ready: extra readiness check (e.g. warm-up done); all models must also be present.
        metrics: the ``Metrics`` to export (default: a new one watching the models' Batchers).
        inference_token: when set, ``/infer`` needs it in the ``servekit-inference-token``
            header (a 401 otherwise); health, metadata and metrics stay open for probes
            and scrapers.
        control_token: when set, changing a model's traffic split
            (``POST /v2/models/<m>/traffic``) needs it in ``servekit-control-token``.
    """

    def __init__(
        self,
        models: Mapping[str, Any] | ModelRegistry,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        ready: Callable[[], bool] | None = None,
        metrics: Metrics | None = None,
        inference_token: str | None = None,
        control_token: str | None = None,
        shared_memory: SharedMemory | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.models = as_registry(models)
        self.tracing = tracing
        """Traces of requests (``servekit.tracing``; None: none, and the trace extension
        is not served)."""
        self.shared_memory = shared_memory
        """The server's shared-memory regions (None: it takes none)."""
        self._token = inference_token.encode() if inference_token else None
        self._control = control_token.encode() if control_token else None
        self.max_body_bytes = max_body_bytes
        self._ready = ready or (lambda: True)
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics.ready = self._ready
        if shared_memory is not None:
            self.metrics.collect(shared_memory.figures)  # CUDA regions' copies
        self._behind = self.models if isinstance(self.models, PassThroughRegistry) else None
        self._routes = [(method, path, getattr(self, name)) for method, path, name in ROUTES]
        self._checked = {}  # Forwarding's: requests' headers that passed the check
        decoupled: dict[str, DecoupledModel] = {}
        for name, model in self.models.loaded().items():
            batchers: dict[str, Batcher | SequenceBatcher]
            if isinstance(model, DecoupledModel):
                decoupled[name] = model
            if isinstance(model, RoutedModel):
                self.metrics.watch_traffic(model.traffic)
                batchers = model.batchers()
            else:
                batchers = {"1": model.batcher} if model.batcher is not None else {}
            for version, batcher in batchers.items():
                if (name, version) not in self.metrics.models:
                    self.metrics.watch(batcher, name, version)
        if decoupled:
            self.metrics.collect(lambda: decoupled_figures(decoupled))

    async def handle(self, request: HttpRequest) -> Answer:
        """Answer one request; never raises: errors map once through ``http_status``."""
        try:
            return await self._route(request)
        except ServekitError as exc:
            return self._error(exc)
        except Exception as exc:  # never let one request take the server down
            log.exception("unexpected error on %s", request.path)
            return self._error(RunnerError(f"internal error: {type(exc).__name__}: {exc}"))

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        """The ASGI adapter over ``handle`` (uvicorn, Ray Serve's ingress): ``asgi``."""
        await serve_asgi(self.handle, self.max_body_bytes, scope, receive, send)

    @staticmethod
    def _json(status: int, data: Any) -> tuple[int, bytes, dict[str, str]]:
        return status, json.dumps(data).encode(), {"content-type": "application/json"}

    def error(self, exc: ServekitError) -> tuple[int, bytes, dict[str, str]]:
        """``exc`` as this app answers it: its status, ``{"error": ...}``, and for
        ``Overloaded`` a ``retry-after``; for a server in front of the app (``ray.direct``)."""
        return self._error(exc)

    def _error(self, exc: ServekitError) -> tuple[int, bytes, dict[str, str]]:
        status, body, headers = self._json(http_status(exc), {"error": str(exc)})
        if isinstance(exc, Overloaded):
            headers["retry-after"] = str(max(1, round(exc.retry_after_s)))
        return status, body, headers

    async def _route(self, request: HttpRequest) -> Answer:
        """The first of ``ROUTES`` whose method and path match answers; a path served
        with other methods only is a 405 naming them (``allow``), as tritonserver's."""
        path, allowed = request.path.rstrip("/"), list[str]()
        for method, pattern, handler in self._routes:
            m = pattern.match(path)
            if m is None:
                continue
            if method == request.method or (method == "*" and not allowed):
                return await handler(request, m)
            if method != "*":  # e.g. PUT /v2/models/stats: the stats, not a model "stats"
                allowed.append(method)
        if allowed:
            return not_allowed(request, *allowed)
        return self._json(404, {"error": f"no route {request.method} {request.path}"})

    async def _live(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        lost = lost_device()  # in this process (native, PyTriton): restart it
        return (200, b"", {}) if lost is None else self._json(503, {"error": lost})

    async def _server_ready(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        return (200 if self._ready() else 503), b"", {}

    async def _metrics(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        # Off the loop: a source may read another server (a front reads tritonserver's).
        text = await asyncio.to_thread(self.metrics.render)
        return 200, text.encode(), {"content-type": CONTENT_TYPE}

    async def _server_metadata(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        return self._json(200, server_metadata())

    async def _index(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        """Triton's repository index: the store's (every model known, with its state),
        tritonserver's own behind a front, else every model served."""
        ready_only = ready_only_asked(self._body(request))
        if conforms(self.models, RepositoryControl):
            index = self.models.index()
            return self._json(200, [e for e in index if e["state"] == "READY" or not ready_only])
        if self._behind is not None:
            return await self._behind.fetch("POST", "/v2/repository/index")
        index = repository_index(self.models.loaded())
        return self._json(200, [e for e in index if e["state"] == "READY" or not ready_only])

    async def _all_stats(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        if self._behind is not None:
            return await self._behind.fetch("GET", "/v2/models/stats")
        return self._json(200, statistics(self.models.loaded()))

    async def _shared_memory(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        body = lambda: self._body(request)  # noqa: E731
        return await shared_memory_answer(
            m, request, body, self.shared_memory, self._behind, self._check_control
        )

    async def _repository_model(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        """A model's load or unload: the store's, or passed to tritonserver with the
        client's control header (it checks the token), else not served here."""
        if conforms(self.models, RepositoryControl):
            return await self._repository(self.models, m["name"], m["action"], request)
        if self._behind is not None:
            given = request.headers.get(CONTROL_TOKEN_HEADER)
            headers = {CONTROL_TOKEN_HEADER: given} if given is not None else {}
            path = f"/v2/repository/models/{urllib.parse.quote(m['name'], safe='')}/{m['action']}"
            return await self._behind.control(path, self._body(request), headers)
        return await self._not_served(request, m)

    async def _trace_setting(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        """Triton's trace extension; behind a front, a change goes on to tritonserver too
        (with the front's control headers), so its own spans follow the same settings."""
        if self.tracing is None:
            why = "is served once [server.tracing] names an OTLP endpoint (tracing is off)"
            return self._json(403, {"error": f"{request.method} {request.path} {why}"})
        body = lambda: self._body(request)  # noqa: E731
        answer = await trace_setting(
            self.tracing, request, m, body, self._check_control, self.models.lookup
        )
        behind = self._behind
        if behind is not None and request.method == "POST" and behind.serves(m["name"] or ""):
            status, said, headers = await behind.restricted("POST", request.wire_path, body())
            if status != 200:
                return status, said, headers
        return answer

    async def _not_served(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        return self._json(403, {"error": f"{request.method} {request.path} {NOT_SERVED}"})

    async def _model(self, request: HttpRequest, m: re.Match[str]) -> Answer:
        """``/v2/models/<m>[/versions/<v>][/ready|/infer|/config|/stats|/traffic]``."""
        method, name, version, rest = request.method, m["name"], m["version"], m["rest"]
        model = await self.models.lookup(name)
        if version is not None and not model.versioned and version not in model.versions:
            raise ModelNotFound(
                f"model {name!r} has no version {version!r}; it has {list(model.versions)}"
            )
        behind = self._behind if self._behind is not None and self._behind.serves(name) else None
        if rest == "/traffic":
            return self._traffic(name, model, request)
        if rest in ("/config", "/stats") and method == "GET":
            if behind is not None:
                return await behind.fetch(method, request.wire_path.rstrip("/"))
            if rest == "/config":
                return self._json(200, model_config_json(name, model))
            return self._json(200, statistics({name: model}))
        unready = rest is None and model.versioned and version
        if unready and not await self.models.is_ready(name, version):
            raise ModelNotFound(f"model {name!r} has no version {version!r} ready")
        if rest is None and method == "GET":
            if behind is not None and not model.versions:  # tritonserver lists its versions
                return await behind.fetch(method, request.wire_path.rstrip("/"))
            return self._json(200, metadata(name, model.spec, model.versions))
        if rest == "/ready" and method == "GET":
            ready = self._ready() and await self.models.is_ready(name, version)
            return (200 if ready else 503), b"", {}
        if rest == "/infer" and method == "POST":
            self._check_token(request.headers.get(INFERENCE_TOKEN_HEADER, "").encode("latin-1"))
            version = version if model.versioned and version else ""
            if self.tracing is None:
                return await self._infer(name, model, request, version)
            with self.tracing.request(name, "infer", request.headers, protocol="http"):
                return await self._infer(name, model, request, version)
        return not_allowed(request, _MODEL_METHODS[rest])

    def _traffic(self, name: str, model: FrontModel, request: HttpRequest) -> Answer:
        """``GET``: the model's split, shadow, canary state and counts; ``POST {"split":
        {...}, "shadow": <version or null>}`` (either or both) sets them, live (behind the
        control token when one is set)."""
        if not isinstance(model, RoutedModel):
            raise ModelNotFound(f"model {name!r} has one version: no traffic split to show or set")
        if request.method == "POST":
            self._check_control(request)
            data = parse_json(self._body(request), "traffic request")
            if not isinstance(data, dict) or not data or set(data) - {"split", "shadow"}:
                raise InvalidInput(
                    'traffic request: expected {"split": {"<version>": <percent>, ...}, '
                    f'"shadow": <version or null>}} (either or both), got {str(data)[:200]}'
                )
            try:
                shadow = model.traffic.parse_shadow(data.get("shadow"))  # checked before any change
                if "split" in data:
                    model.traffic.set_split(data["split"])
                if "shadow" in data:
                    model.traffic.set_shadow(shadow)
            except ValueError as exc:  # a bad split is this request's fault
                raise exc if isinstance(exc, InvalidInput) else InvalidInput(str(exc)) from None
        elif request.method != "GET":
            return not_allowed(request, "GET", "POST")
        return self._json(200, model.traffic.state_dict())

    async def _repository(
        self, control: RepositoryControl, name: str, action: str, request: HttpRequest
    ) -> Answer:
        """``POST /v2/repository/models/<m>/load|unload`` (Triton's repository extension),
        behind the control token; a load's ``parameters.config`` is Triton's model config
        JSON (batching and instances)."""
        self._check_control(request)
        body = self._body(request)
        data = parse_json(body, f"repository {action} request") if body.strip() else {}
        params = data.get("parameters", {}) if isinstance(data, dict) else None
        if not isinstance(params, dict):
            raise InvalidInput(
                f'repository {action} request: expected {{"parameters": {{...}}}}, '
                f"got {str(data)[:200]}"
            )
        files = sorted(k for k in params if k.startswith("file:"))
        if files:
            raise InvalidInput(
                f"repository {action}: model files in the request ({files}) are not taken; "
                "put them in the store's root"
            )
        if action == "unload":
            await control.unload(name)
            return 200, b"", {}
        config = params.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidInput(
                "repository load: parameters.config must be a JSON string, "
                f"got {type(config).__name__}"
            )
        override = (
            parse_json(config.encode(), "repository load: parameters.config") if config else None
        )
        if override is not None and not isinstance(override, dict):
            raise InvalidInput("repository load: parameters.config must be a JSON object")
        await control.load(name, override)
        return 200, b"", {}

    def _check_control(self, request: HttpRequest) -> None:
        given = request.headers.get(CONTROL_TOKEN_HEADER, "").encode("latin-1")
        if self._control is not None and not hmac.compare_digest(given, self._control):
            raise Unauthenticated(f"missing or wrong {CONTROL_TOKEN_HEADER} header")

    def _check_token(self, given: bytes) -> None:
        if self._token is not None and not hmac.compare_digest(given, self._token):
            raise Unauthenticated(f"missing or wrong {INFERENCE_TOKEN_HEADER} header")

    def _decode(
        self, name: str, body: bytes, raw: str | None, regions: Regions | None = None
    ) -> DecodedRequest:
        """The request, checked; a malformed one counts as failed (it never reaches a
        Batcher). Its shared-memory tensors are read from ``regions`` (default: the
        server's own)."""
        try:
            if raw and not (raw.isascii() and raw.isdigit()):
                raise InvalidInput(f"header {HEADER_LENGTH}: expected a byte count, got {raw!r}")
            return decode_request(body, int(raw) if raw else None, regions or self.shared_memory)
        except InvalidInput:
            self.metrics.failed(name)
            raise

    def _regions_for(self, model: object) -> Regions | None:
        """The server's regions as ``model`` reads them (CUDA inputs stay on its GPU)."""
        shm = self.shared_memory
        return None if shm is None else shm.for_device(input_device(model))

    def _body(self, request: HttpRequest) -> bytes:
        """The body, decompressed (gzip/deflate); the size limit holds for what it
        decompresses to as for what came over the wire."""
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", "", *ENCODINGS):
            raise UnsupportedEncoding(
                f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none"
            )
        body = request.body
        if encoding not in ENCODINGS:
            return body
        plain = inflate(body, encoding, self.max_body_bytes, "request body")
        if len(plain) > self.max_body_bytes:
            raise PayloadTooLarge(len(plain), self.max_body_bytes, "decompressed request body")
        return plain

    async def _infer(
        self,
        name: str,
        model: FrontModel,
        http: HttpRequest,
        version: str,
    ) -> Answer:
        body = self._body(http)
        raw = http.headers.get(HEADER_LENGTH)
        whole = whole_body(raw)
        if getattr(model, "decoupled", False):
            request = self._decode(name, body, raw)
            return event_stream(
                name, cast(Decoupled, model), request, http.headers.get("accept", "")
            )
        if conforms(model, PassThrough) and not whole:  # checked; Triton gets the same bytes
            c = self._pass_through(name, model, body, raw)
            return await model.forward(c.body, c.length, version, c.timeout_us, c.sequence)
        if isinstance(model, RoutedModel) and not whole and model.passes_through:
            c = self._pass_through(name, model, body, raw)
            header = model.traffic.sticky
            sticky = http.headers.get(header) if header else None
            answer, _ = await model.forward_routed(c.body, c.length, version, sticky, c.timeout_us)
            return answer
        if whole:  # the whole body is the one input
            spec = model.spec
            try:
                request = raw_binary_request(spec, body)
            except InvalidInput:
                self.metrics.failed(name)
                raise
            if conforms(model, PassThrough):
                spec.validate_inputs(request.inputs)
                return await model.forward(body, 0, version)
        else:
            request = self._decode(name, body, raw, self._regions_for(model))
        params = scheduling(request.parameters)
        outputs, answered = await infer_answered(
            model, request.inputs, **params, version=version, sticky_of=http.headers.get,
            sequence=sequence_flags(request.parameters), name=name,
        )  # fmt: skip
        payload, out_headers = encode_response(name, outputs, request, answered)
        return 200, payload, out_headers


def metrics_handler(render: Callable[[], str]) -> Handler:
    """``GET /metrics`` alone: the Prometheus exposition on a metrics port of its own."""

    async def handle(request: HttpRequest) -> Answer:
        if request.method == "GET" and request.path.rstrip("/") == "/metrics":
            return 200, render().encode(), {"content-type": CONTENT_TYPE}
        return 404, b'{"error": "only GET /metrics is served here"}', _JSON

    return handle
