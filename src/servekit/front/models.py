"""What the front knows of the models behind it: PyTriton's, known up front
(``PyTritonModels``), and a tritonserver repository's, read from Triton when asked
(``TritonModels``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, cast

from ..batching.policy import QueuePolicy
from ..cache import ResponseCache
from ..cuda import lost
from ..errors import ModelNotFound, ModelNotReady
from ..protocol.models import FrontModel, StaticModels, as_front_model
from ..protocol.routed import RoutedModel
from ..protocol.surface import repository_index
from ..recovery import Recovery
from ..rollout import Traffic
from ..spec import spec_from_config
from .cached import FrontCache
from .forwarded import ForwardedModel, TritonVersion
from .private import triton_fetch, triton_ready
from .window import Window, limit_from_triton, queue_of_triton

__all__ = ["PyTritonModels", "TritonModels", "version_ready"]

POLL_TTL_S = 2.0
"""How long a model's config read from tritonserver stands in poll mode."""

log = logging.getLogger(__name__)


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


class PyTritonModels(StaticModels):
    """PyTriton's models (fixed at start) as ``ForwardedModel``s, a routed model's versions
    as one ``RoutedModel``; readiness, configuration, statistics and the repository index
    come from tritonserver (``PassThroughRegistry``).

    ``routes``: name -> version -> the Triton model serving it (PyTriton binds one version
    per Triton model); those Triton models are not served under their own names.
    ``local``: models the front serves itself, in servekit's process (sequence and
    decoupled models, which PyTriton cannot schedule): name -> a Batcher or front model.
    """

    def __init__(
        self,
        models: Mapping[str, ForwardedModel],
        http_url: str,
        headers: Mapping[str, str],
        *,
        routes: Mapping[str, Mapping[int, str]] | None = None,
        traffic: Mapping[str, Traffic] | None = None,
        local: Mapping[str, Any] | None = None,
    ) -> None:
        self.local = {name: as_front_model(m) for name, m in (local or {}).items()}
        served: dict[str, FrontModel] = {**models, **self.local}
        for name, targets in (routes or {}).items():
            for target in targets.values():
                served.pop(target, None)
            assert traffic is not None and name in traffic, f"{name}: routed without a Traffic"
            served[name] = RoutedModel(
                {v: TritonVersion(models[t]) for v, t in targets.items()}, traffic[name]
            )
        super().__init__(served)
        self.forwarded = dict(models)
        self.http_url, self.control_headers = http_url, dict(headers)

    async def is_ready(self, name: str, version: str | None) -> bool:
        model = self._models.get(name)
        if lost():  # servekit's process runs PyTriton's models: its device is theirs
            return False
        if name in self.local:
            return await super().is_ready(name, version)
        if isinstance(model, RoutedModel):
            return await version_ready(model, version, self.http_url)
        return model is not None and await triton_ready(self.http_url, name, version)

    def peek(self, name: str) -> ForwardedModel | None:
        model = self._models.get(name)  # only these are listed; a routed one takes the full path
        return model if isinstance(model, ForwardedModel) else None

    def serves(self, name: str) -> bool:
        return name not in self.local

    async def fetch(self, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
        if path == "/v2/repository/index":  # PyTriton's models are in no repository Triton indexes
            return (
                200,
                json.dumps(repository_index(self)).encode(),
                {"content-type": "application/json"},
            )
        return await triton_fetch(self.http_url, self.control_headers, method, path)

    async def control(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        why = (
            f"POST {path}: PyTriton cannot load or unload a model (pytriton#21): its models "
            "are bound at start (the native runtime's [store] and the triton runtime can)"
        )
        return 403, json.dumps({"error": why}).encode(), {"content-type": "application/json"}

    async def restricted(
        self, method: str, path: str, body: bytes | None
    ) -> tuple[int, bytes, dict[str, str]]:
        return await triton_fetch(self.http_url, self.control_headers, method, path, body)

    async def aclose(self) -> None:
        for model in self.forwarded.values():
            await model.aclose()


class TritonModels(Mapping[str, ForwardedModel]):
    """The models a tritonserver has loaded now, for the front: each one's spec is read
    from Triton's model config (private HTTP port) when first asked for, and read again
    only when it can have changed: after a load or unload through the front (explicit
    mode; with no model control, never), or after ``ttl_s`` in poll mode, where
    tritonserver reloads on its own. A model with a ``Traffic`` is served as a
    ``RoutedModel`` over its Triton versions."""

    def __init__(
        self,
        http_url: str,
        grpc_url: str,
        *,
        inference_token: str | None = None,
        control_headers: Mapping[str, str] | None = None,
        ttl_s: float | None = None,
        traffic: Mapping[str, Traffic] | None = None,
        recovery: Recovery | None = None,
        control_mode: str = "explicit",
        cached: Mapping[str, Callable[[], str]] | None = None,
        cache: ResponseCache | None = None,
        shed_late: Collection[str] = (),
    ) -> None:
        self.http_url, self.grpc_url = http_url, grpc_url
        self.shed_late = frozenset(shed_late)
        """Models whose front window sheds what cannot make its deadline (``front.window``)."""
        self.cached, self.response_cache = dict(cached or {}), cache
        """Models with ``response_cache`` (name -> the identity of what it serves)."""
        if ttl_s is None:  # only poll mode changes a model behind the front's back
            ttl_s = POLL_TTL_S if control_mode == "poll" else math.inf
        self.ttl_s = ttl_s
        self.recovery, self.control_mode = recovery, control_mode
        self._token, self.control_headers = inference_token, dict(control_headers or {})
        self._cache: dict[str, tuple[float, ForwardedModel]] = {}
        self.traffic = dict(traffic or {})
        self._routed: dict[str, RoutedModel] = {}
        self._retired: list[ForwardedModel] = []
        self._windows: dict[str, Window] = {}
        self._lock = threading.Lock()

    def _get(self, path: str) -> Any:
        request = urllib.request.Request(f"{self.http_url}{path}", headers=self.control_headers)
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
        return await triton_fetch(self.http_url, self.control_headers, method, path)

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
        answer = await triton_fetch(self.http_url, headers, "POST", path, body, control=True)
        name = urllib.parse.unquote(path.split("/")[4])
        cached = self._cache.get(name)
        if cached is not None:  # looked up afresh next time (kept while it serves the same spec)
            self._cache[name] = (float("-inf"), cached[1])
        return answer

    async def restricted(
        self, method: str, path: str, body: bytes | None
    ) -> tuple[int, bytes, dict[str, str]]:
        """tritonserver's answer (``PassThroughRegistry``)."""
        return await triton_fetch(self.http_url, self.control_headers, method, path, body)

    def stale(self) -> None:
        """Read every model's config again when next asked (tritonserver restarted: what it
        loaded through the API before is gone)."""
        self._cache = {name: (-math.inf, model) for name, (_, model) in self._cache.items()}

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
        config = self._get(f"/v2/models/{quoted}/config")
        spec = spec_from_config(config)
        sequencing = config.get("sequence_batching") or {}
        sequenced = bool(sequencing)
        decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled"))
        idle_us = int(sequencing.get("max_sequence_idle_microseconds") or 1_000_000)
        now = time.monotonic()
        cached = self._cache.get(name)
        same = (spec, sequenced, decoupled)
        if (
            cached is not None
            and (cached[1].spec, cached[1].sequenced, cached[1].decoupled) == same
        ):
            model = cached[1]
        else:
            if cached is not None:  # requests may still use it: closed with the registry
                self._retired.append(cached[1])
            model = ForwardedModel(
                name, spec, self.grpc_url, self._token,
                http_url=self.http_url, recovery=self.recovery, sequenced=sequenced,
                sequence_idle_s=idle_us / 1e6, decoupled=decoupled,
            )  # fmt: skip
        # Versions served side by side are one Triton model, each with its own instances:
        # one window would let a slow version's requests hold the others' places.
        limit = 0 if name in self.traffic else limit_from_triton(config)
        model.window = self._window(name, limit, queue_of_triton(config))
        if self.response_cache is not None and name in self.cached and model.cache is None:
            model.cache = FrontCache(self.response_cache, name, self.cached[name])
        self._cache[name] = (now, model)
        return model

    def _window(self, name: str, limit: int, queue: QueuePolicy) -> Window | None:
        """The model's one window (``front.window``), made again only when its limit or
        queue policy changed: two threads reading its config at once (``lookup``) share it."""
        with self._lock:
            window = self._windows.get(name)
            if not limit:
                self._windows.pop(name, None)
                return None
            if window is None or (window.limit, window.queue) != (limit, queue):
                window = Window(name, limit, shed_late=name in self.shed_late, queue=queue)
                self._windows[name] = window
            return window

    def windows(self) -> list[Window]:
        """Every model's window (a snapshot: lookups add to them from other threads)."""
        with self._lock:
            return list(self._windows.values())

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

    def serves(self, name: str) -> bool:
        return True

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
