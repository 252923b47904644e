"""servekit's hardened KServe v2 front on Triton's public HTTP port (the Triton runtimes').

tritonserver 2.51 (the one PyTriton 0.7 bundles) aborts on one JSON request whose shape
claims more elements than memory holds, and answers malformed ``data`` with 500s. With
``ServerConfig(front=True)`` (the default) Triton's HTTP endpoint moves
to loopback on a private port and the public HTTP port is servekit's ``KServeApp``: it
decodes and checks every request against the model's spec before anything is
allocated (the same code as the native runtime and the Ray ingress), then passes the
request's bytes on untouched to Triton's HTTP port on loopback (``HttpForwarder``: a
pooled keep-alive connection) and Triton's answer back as it is. Triton's gRPC moves to
loopback too: the public gRPC port is servekit's own HTTP/2 server (``relay``), which
passes calls on as their bytes, because tritonserver's HTTP/2 falls to a rapid reset.

PyTriton's models are known up front (``Front(models=...)``); a model repository's come
and go (explicit loads, polling), so ``servekit triton`` gives the front a
``TritonModels`` registry that reads each model's config from Triton when asked.

A model served in several versions with a traffic split (``[models.traffic]``) is a
``RoutedModel`` here, as on the native runtime: the front picks the version, runs the
shadow and feeds the canary, and asks Triton for that version (``TritonVersion``), on
HTTP and on gRPC (servekit's ``GrpcService`` then decodes the call).

The server itself (``Front``: HTTP and gRPC on one loop) is in ``server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import numpy as np

from ..batching import Batcher
from ..errors import INFERENCE_TOKEN_HEADER, ModelNotFound, ModelNotReady, ServekitError
from ..protocol.kserve import HEADER_LENGTH
from ..protocol.models import FrontModel, StaticModels
from ..protocol.routed import RoutedModel
from ..protocol.surface import repository_index
from ..recovery import Lost, Recovery, fingerprint, tensors_key
from ..rollout import Traffic
from ..spec import ModelSpec, spec_from_config
from .grpc import GrpcForwarder, Status
from .http import Answer, Done, Dropped, HttpForwarder

__all__ = ["ForwardedModel", "PyTritonModels", "TritonModels", "TritonVersion"]

log = logging.getLogger(__name__)


class ForwardedModel:
    """A model Triton serves, as the front sees it: the spec, checked requests passed on to
    Triton's HTTP port (``forward``), and ``infer`` with tensors over gRPC."""

    batcher: Batcher | None = None
    """Triton batches; its own metrics port exports the counters."""
    versioned = True
    """The front passes ``/versions/<v>/`` through; Triton answers for the versions it has."""
    versions: tuple[str, ...] = ()
    """Triton lists them (metadata and the index pass through to it)."""

    def __init__(
        self,
        name: str,
        spec: ModelSpec,
        grpc_url: str,
        token: str | None = None,
        *,
        http_url: str | None = None,
        recovery: Recovery | None = None,
    ) -> None:
        self.name, self.spec, self.url, self._token = name, spec, grpc_url, token
        self.http_url, self.recovery = http_url, recovery
        self._client: GrpcForwarder | None = None
        self._http: HttpForwarder | None = None
        self._replays: set[asyncio.Task[Any]] = set()
        quoted = urllib.parse.quote(name, safe="")
        self._paths = (f"/v2/models/{quoted}/infer", f"/v2/models/{quoted}/versions/{{}}/infer")

    def _forwarder(self) -> HttpForwarder:
        """The pooled connections, made on first use: they belong to the front's loop."""
        if self.http_url is None:
            raise ModelNotReady(f"{self.name}: no HTTP endpoint to forward to")
        headers = {INFERENCE_TOKEN_HEADER: self._token} if self._token else None
        self._http = HttpForwarder(self.http_url, headers=headers)
        return self._http

    def _request(self, body: bytes, header_length: int | None, version: str) -> bytes:
        http = self._http or self._forwarder()
        path = (
            self._paths[0]
            if not version
            else self._paths[1].format(urllib.parse.quote(version, safe=""))
        )
        extra = {HEADER_LENGTH: str(header_length)} if header_length is not None else None
        return http.request_bytes(path, body, extra)

    def _lost(self, outcome: Answer | ServekitError) -> Lost | None:
        """What a worker death (or none live) did to an attempt, as tritonserver shows it."""
        if isinstance(outcome, Dropped):  # tritonserver died, or the restart killed it
            return Lost.DEAD
        if isinstance(outcome, ServekitError):
            return Lost.UNREACHABLE  # tritonserver not answering (restarting)
        status, body = outcome[0], outcome[1]
        if status == 200:
            return None
        if status == 500 and _STUB_DEAD in body:
            return Lost.DEAD
        recovery = self.recovery
        if recovery is not None and not recovery.live(self.name) and _RELOADING.search(body):
            return Lost.UNREACHABLE  # a restarted tritonserver still loading the model
        return None

    async def forward(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        timeout_us: int | None = None,
    ) -> Answer:
        """The checked request to Triton's own HTTP port, the same bytes, on a pooled
        keep-alive loopback connection; Triton's answer as it is (``PassThrough``),
        re-sent if its worker dies (``recovery``)."""
        request = self._request(body, header_length, version)
        http = cast(HttpForwarder, self._http)
        recovery = self.recovery
        if recovery is None:
            outcome = await http.exchange(request)
        else:
            key = functools.partial(fingerprint, self.name, version.encode(), body)
            recovery.refuse_poison(self.name, key)
            live, arrived = recovery.live(self.name), time.monotonic()
            outcome = await recovery.replay(
                self.name, functools.partial(http.exchange, request), self._lost,
                deadline=recovery.deadline(timeout_us, arrived), key=key,
                first=await http.exchange(request), first_sent_live=live,
            )  # fmt: skip
        if isinstance(outcome, ServekitError):
            raise outcome
        return outcome

    def send(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        done: Done,
        timeout_us: int | None = None,
    ) -> None:
        """``forward`` from callbacks: no task, no future (the front's fast path) unless
        the worker died under the request."""
        request = self._request(body, header_length, version)
        http = cast(HttpForwarder, self._http)
        recovery = self.recovery
        if recovery is None:
            http.send(request, done)
            return
        key = functools.partial(fingerprint, self.name, version.encode(), body)
        try:
            recovery.refuse_poison(self.name, key)
        except ServekitError as exc:
            done(exc)
            return
        live, arrived = recovery.live(self.name), time.monotonic()

        def first(outcome: Answer | ServekitError) -> None:
            if self._lost(outcome) is None:
                if not live:
                    recovery.answered(self.name)
                done(outcome)
                return
            replay = recovery.replay(
                self.name, functools.partial(http.exchange, request), self._lost,
                deadline=recovery.deadline(timeout_us, arrived), key=key,
                first=outcome, first_sent_live=live,
            )  # fmt: skip
            task = asyncio.get_running_loop().create_task(replay)
            self._replays.add(task)
            task.add_done_callback(functools.partial(self._replayed, done))

        http.send(request, first)

    def _replayed(self, done: Done, task: asyncio.Task[Any]) -> None:
        self._replays.discard(task)
        if task.cancelled():
            done(ModelNotReady(f"{self.name}: the front stopped while the request waited"))
            return
        exc = task.exception()
        if exc is None:
            done(task.result())
        else:
            done(exc if isinstance(exc, ServekitError) else ModelNotReady(str(exc)))

    def _grpc(self) -> GrpcForwarder:
        if self._client is None:  # a gRPC aio channel belongs to the loop that made it
            headers = {INFERENCE_TOKEN_HEADER: self._token} if self._token else None
            self._client = GrpcForwarder(self.url, headers=headers)
        return self._client

    def _relay_lost(self, outcome: bytes | Status) -> Lost | None:
        """``_lost`` for a gRPC call passed on as bytes."""
        if not isinstance(outcome, Status):
            return None
        if _STUB_DEAD.decode() in outcome.details:
            return Lost.DEAD
        if outcome.code.name == "UNAVAILABLE":  # the connection: never made, or cut with the call
            return Lost.UNREACHABLE if "failed to connect" in outcome.details else Lost.DEAD
        recovery = self.recovery
        reloading = _RELOADING.search(outcome.details.encode())
        if reloading and recovery is not None and not recovery.live(self.name):
            return Lost.UNREACHABLE
        return None

    async def relay(
        self,
        body: bytes,
        key: Callable[[], bytes],
        *,
        timeout_us: int | None = None,
        metadata: tuple[tuple[str, Any], ...] = (),
    ) -> bytes | Status:
        """A checked ``ModelInferRequest`` message to Triton's gRPC port as its bytes, and
        Triton's answer as it is; re-sent if its worker dies (``recovery``, with ``key``
        the request's poison fingerprint)."""
        send = functools.partial(self._grpc().call, "ModelInfer", body, metadata)
        recovery = self.recovery
        if recovery is None:
            return await send()
        recovery.refuse_poison(self.name, key)
        live, arrived = recovery.live(self.name), time.monotonic()
        outcome = await recovery.replay(
            self.name, send, self._relay_lost, deadline=recovery.deadline(timeout_us, arrived),
            key=key, first=await send(), first_sent_live=live,
        )  # fmt: skip
        return cast("bytes | Status", outcome)

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        self.spec.validate_inputs(inputs)
        client = self._grpc()
        recovery = self.recovery

        async def attempt() -> dict[str, np.ndarray] | ServekitError:
            try:
                return await client.infer(
                    self.name, inputs, priority=priority, timeout_us=timeout_us, version=version
                )
            except ServekitError as exc:
                if recovery is None:
                    raise
                return exc

        if recovery is None:
            return cast(dict[str, np.ndarray], await attempt())
        key = tensors_key(self.name, version, inputs)
        recovery.refuse_poison(self.name, key)
        live, arrived = recovery.live(self.name), time.monotonic()
        outcome = await recovery.replay(
            self.name, attempt, _grpc_lost, deadline=recovery.deadline(timeout_us, arrived),
            key=key, first=await attempt(), first_sent_live=live,
        )  # fmt: skip
        if isinstance(outcome, ServekitError):
            raise outcome
        return cast(dict[str, np.ndarray], outcome)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._http is not None:
            await self._http.close()
            self._http = None


_STUB_DEAD = b"is not healthy"
"""tritonserver 2.51's answer while a model instance's Python backend stub is dead:
"Stub process '<instance>' is not healthy." """
_RELOADING = re.compile(rb"unknown model|is not ready|no available versions|not found")
"""tritonserver's answers for a model it has not loaded (yet)."""


def _grpc_lost(outcome: dict[str, np.ndarray] | ServekitError) -> Lost | None:
    """``ForwardedModel._lost`` for gRPC: a call cut off reads as tritonserver gone."""
    if not isinstance(outcome, ServekitError):
        return None
    if "is not healthy" in str(outcome):
        return Lost.DEAD
    return Lost.UNREACHABLE if isinstance(outcome, ModelNotReady) else None


class TritonVersion:
    """One version of a routed model as Triton serves it: a Triton model at a version
    (``""``: the one it has). ``RoutedModel`` chooses among these; Triton batches."""

    versioned = False
    versions: tuple[str, ...] = ("1",)
    batcher: Batcher | None = None

    def __init__(self, model: ForwardedModel, version: str = "") -> None:
        self.model, self.version, self.spec = model, version, model.spec

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        return await self.model.infer(
            inputs, priority=priority, timeout_us=timeout_us, version=self.version
        )

    def pass_through(self) -> tuple[ForwardedModel, str] | None:
        """Triton's answer names the routed model and version as they are only where the
        version is Triton's own (the triton runtime), not a model of its own (PyTriton's)."""
        return (self.model, self.version) if self.version else None

    async def ready(self, http_url: str) -> bool:
        return await triton_ready(http_url, self.model.name, self.version or None)


async def version_ready(model: RoutedModel, version: str | None, http_url: str) -> bool:
    """Whether Triton has the routed model's named version (every version: none named) ready."""
    if version:
        try:
            versions = [model.by_version[model.traffic.version(version)]]
        except ModelNotFound:
            return False
    else:
        versions = list(model.by_version.values())
    for target in versions:
        if not await cast(TritonVersion, target).ready(http_url):
            return False
    return True


async def triton_fetch(
    http_url: str,
    headers: Mapping[str, str],
    method: str,
    path: str,
    body: bytes | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    """tritonserver's answer to a request on its private HTTP port, as it is (a POST
    without ``body`` sends ``{}``)."""

    def call() -> tuple[int, bytes, dict[str, str]]:
        request = urllib.request.Request(
            f"{http_url}{path}",
            method=method,
            headers=dict(headers),
            data=(body or b"{}") if method == "POST" else None,
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, r.read(), {"content-type": "application/json"}
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), {"content-type": "application/json"}
        except (urllib.error.URLError, OSError) as exc:
            raise ModelNotReady(f"tritonserver is not answering: {exc}") from None

    return await asyncio.to_thread(call)


async def triton_ready(http_url: str, name: str, version: str | None) -> bool:
    """Whether tritonserver has ``name`` (at ``version``) ready."""
    path = f"/v2/models/{urllib.parse.quote(name, safe='')}"
    if version:
        path += f"/versions/{urllib.parse.quote(version, safe='')}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{http_url}{path}/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    return await asyncio.to_thread(ready)


class PyTritonModels(StaticModels):
    """PyTriton's models (fixed at start) as ``ForwardedModel``s, a routed model's versions
    as one ``RoutedModel``; readiness, configuration, statistics and the repository index
    come from tritonserver (``PassThroughRegistry``).

    ``routes``: name -> version -> the Triton model serving it (PyTriton binds one version
    per Triton model); those Triton models are not served under their own names.
    """

    def __init__(
        self,
        models: Mapping[str, ForwardedModel],
        http_url: str,
        headers: Mapping[str, str],
        *,
        routes: Mapping[str, Mapping[int, str]] | None = None,
        traffic: Mapping[str, Traffic] | None = None,
    ) -> None:
        served: dict[str, FrontModel] = dict(models)
        for name, targets in (routes or {}).items():
            for target in targets.values():
                served.pop(target, None)
            assert traffic is not None and name in traffic, f"{name}: routed without a Traffic"
            served[name] = RoutedModel(
                {v: TritonVersion(models[t]) for v, t in targets.items()}, traffic[name]
            )
        super().__init__(served)
        self.forwarded = dict(models)
        self.http_url, self._headers = http_url, dict(headers)

    async def is_ready(self, name: str, version: str | None) -> bool:
        model = self._models.get(name)
        if isinstance(model, RoutedModel):
            return await version_ready(model, version, self.http_url)
        return model is not None and await triton_ready(self.http_url, name, version)

    def peek(self, name: str) -> ForwardedModel | None:
        model = self._models.get(name)  # only these are listed; a routed one takes the full path
        return model if isinstance(model, ForwardedModel) else None

    async def fetch(self, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
        if path == "/v2/repository/index":  # PyTriton's models are in no repository Triton indexes
            return (
                200,
                json.dumps(repository_index(self)).encode(),
                {"content-type": "application/json"},
            )
        return await triton_fetch(self.http_url, self._headers, method, path)

    async def control(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        why = (
            f"POST {path}: PyTriton cannot load or unload a model (pytriton#21): its models "
            "are bound at start (the native runtime's [store] and the triton runtime can)"
        )
        return 403, json.dumps({"error": why}).encode(), {"content-type": "application/json"}

    async def aclose(self) -> None:
        for model in self.forwarded.values():
            await model.aclose()


class TritonModels(Mapping[str, ForwardedModel]):
    """The models a tritonserver has loaded now, for the front: each one's spec is read
    from Triton's model config (private HTTP port) when first asked for and again after
    ``ttl_s``, so models loaded, unloaded or re-configured later are seen. A model with a
    ``Traffic`` is served as a ``RoutedModel`` over its Triton versions."""

    def __init__(
        self,
        http_url: str,
        grpc_url: str,
        *,
        inference_token: str | None = None,
        control_headers: Mapping[str, str] | None = None,
        ttl_s: float = 2.0,
        traffic: Mapping[str, Traffic] | None = None,
        recovery: Recovery | None = None,
        control_mode: str = "explicit",
    ) -> None:
        self.http_url, self.grpc_url, self.ttl_s = http_url, grpc_url, ttl_s
        self.recovery, self.control_mode = recovery, control_mode
        self._token, self._headers = inference_token, dict(control_headers or {})
        self._cache: dict[str, tuple[float, ForwardedModel]] = {}
        self.traffic = dict(traffic or {})
        self._routed: dict[str, RoutedModel] = {}
        self._retired: list[ForwardedModel] = []

    def _get(self, path: str) -> Any:
        request = urllib.request.Request(f"{self.http_url}{path}", headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                detail = json.loads(detail)["error"]
            # Triton answers 400 for a model it does not have; anything else is its trouble.
            error = ModelNotFound if exc.code in (400, 404) else ModelNotReady
            raise error(f"Triton: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ModelNotReady(f"tritonserver is not answering: {exc}") from None

    async def fetch(self, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
        """Triton's own answer on its private HTTP port (``PassThroughRegistry``)."""
        return await triton_fetch(self.http_url, self._headers, method, path)

    async def control(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        """Model control passed to tritonserver with the client's own control header (Triton
        checks it); the model is looked up afresh after. Outside explicit mode tritonserver
        refuses it as UNAVAILABLE (503), which tells a client to retry what can never
        work: the front refuses it first, as the client's request (400), naming the flag."""
        why = self.control_refused()
        if why is not None:
            why = f"POST {path}: {why}"
            return 400, json.dumps({"error": why}).encode(), {"content-type": "application/json"}
        answer = await triton_fetch(self.http_url, headers, "POST", path, body)
        name = urllib.parse.unquote(path.split("/")[4])
        cached = self._cache.get(name)
        if cached is not None:  # looked up afresh next time (kept while it serves the same spec)
            self._cache[name] = (float("-inf"), cached[1])
        return answer

    def control_refused(self) -> str | None:
        """Why tritonserver cannot load or unload a model now (None: it can)."""
        if self.control_mode == "explicit":
            return None
        return (
            f"tritonserver runs with --model-control-mode {self.control_mode}: loading and "
            "unloading models needs explicit mode (servekit triton --model-control-mode explicit)"
        )

    def _fetch(self, name: str) -> ForwardedModel:
        quoted = urllib.parse.quote(name, safe="")
        spec = spec_from_config(self._get(f"/v2/models/{quoted}/config"))
        now = time.monotonic()
        cached = self._cache.get(name)
        if cached is not None and cached[1].spec == spec:
            model = cached[1]
        else:
            if cached is not None:  # requests may still use it: closed with the registry
                self._retired.append(cached[1])
            model = ForwardedModel(
                name, spec, self.grpc_url, self._token,
                http_url=self.http_url, recovery=self.recovery,
            )  # fmt: skip
        self._cache[name] = (now, model)
        return model

    async def lookup(self, name: str) -> FrontModel:
        """The model ``name`` as Triton has it now (``ModelNotFound`` naming it if it has not)."""
        cached = self._cache.get(name)
        if cached is not None and time.monotonic() - cached[0] < self.ttl_s:
            model = cached[1]
        else:
            model = await asyncio.to_thread(self._fetch, name)
        return self._route(name, model) if name in self.traffic else model

    def _route(self, name: str, model: ForwardedModel) -> RoutedModel:
        """The routed model over ``model``'s versions (made again when ``model`` changed)."""
        routed = self._routed.get(name)
        if routed is None or routed.spec is not model.spec:
            traffic = self.traffic[name]
            targets = {v: TritonVersion(model, str(v)) for v in traffic.versions}
            routed = self._routed[name] = RoutedModel(targets, traffic)
        return routed

    async def is_ready(self, name: str, version: str | None) -> bool:
        return await triton_ready(self.http_url, name, version)

    def peek(self, name: str) -> ForwardedModel | None:
        cached = self._cache.get(name)
        if cached is None or time.monotonic() - cached[0] >= self.ttl_s or name in self.traffic:
            return None  # a routed model takes the full path
        return cached[1]

    def loaded(self) -> Mapping[str, FrontModel]:
        return {
            name: self._route(name, model) if name in self.traffic else model
            for name, (_, model) in self._cache.items()
        }

    def __getitem__(self, name: str) -> ForwardedModel:
        return self._cache[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._cache)

    def __len__(self) -> int:
        return len(self._cache)

    async def aclose(self) -> None:
        for model in [*(m for _, m in self._cache.values()), *self._retired]:
            await model.aclose()
