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
``TritonModels`` registry that reads each model's config from Triton when asked (both
registries are in ``models``).

A model served in several versions with a traffic split (``[models.traffic]``) is a
``RoutedModel`` here, as on the native runtime: the front picks the version, runs the
shadow and feeds the canary, and asks Triton for that version (``TritonVersion``), on
HTTP and on gRPC (servekit's ``GrpcService`` then decodes the call).

The server itself (``Front``: HTTP and gRPC on one loop) is in ``server``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, cast

import numpy as np

from .. import tracing
from ..batching import Batcher
from ..batching.sequence import SequenceFlags
from ..errors import INFERENCE_TOKEN_HEADER, ModelNotReady, ServekitError, from_grpc_code
from ..protocol.kserve import HEADER_LENGTH
from ..recovery import Lost, Recovery, fingerprint, tensors_key
from ..spec import ModelSpec
from ..tracing import TRACEPARENT
from .cached import FrontCache
from .grpc import GrpcForwarder, Status, infer_request, response_outputs
from .http import Answer, Done, Dropped, HttpForwarder
from .journal import SequenceJournal
from .private import triton_ready
from .window import Window, due_s

__all__ = ["ForwardedModel", "TritonVersion"]

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
        sequenced: bool = False,
        sequence_idle_s: float = 1.0,
        decoupled: bool = False,
    ) -> None:
        self.name, self.spec, self.url, self._token = name, spec, grpc_url, token
        self.decoupled = decoupled
        """Triton answers each request with 0..N responses (``responses``, ``stream``)."""
        self.cache: FrontCache | None = None
        """Its answers kept (``response_cache``), where the runtime set one."""
        self.window: Window | None = None
        """How many of its requests are with tritonserver at once (``front.window``);
        None: all of them."""
        self.sequenced = sequenced
        """tritonserver runs it with its sequence batcher: a request may name a sequence."""
        self.journal = (
            SequenceJournal(name, recovery, sequence_idle_s)
            if sequenced and recovery is not None
            else None
        )
        """Its live sequences' requests, to rebuild them on a restarted worker."""
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
        extra = {HEADER_LENGTH: str(header_length)} if header_length is not None else {}
        parent = tracing.outgoing()
        if parent is not None:  # tritonserver's spans join the request's trace
            extra[TRACEPARENT] = parent
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
        sequence: SequenceFlags | None = None,
    ) -> Answer:
        """The checked request to Triton's own HTTP port, the same bytes, on a pooled
        keep-alive loopback connection; Triton's answer as it is (``PassThrough``),
        re-sent if its worker dies (``recovery``; a sequence's, after its state is
        rebuilt on the new worker: ``journal``); answered from ``cache`` where it holds
        the same request's answer."""
        if self.cache is not None and sequence is None:
            sent = functools.partial(self._forward, body, header_length, version, timeout_us)
            return await self.cache.http(version, body, header_length, sent)
        return await self._forward(body, header_length, version, timeout_us, sequence)

    async def _forward(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        timeout_us: int | None = None,
        sequence: SequenceFlags | None = None,
    ) -> Answer:
        window = self.window
        if window is None or sequence is not None:
            return await self._forward_now(body, header_length, version, timeout_us, sequence)
        sent = functools.partial(self._forward_now, body, header_length, version, timeout_us)
        return cast(
            Answer, await window.through(sent, due_s(timeout_us), self._replays, timeout_us)
        )

    async def _forward_now(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        timeout_us: int | None,
        sequence: SequenceFlags | None = None,
    ) -> Answer:
        request = self._request(body, header_length, version)
        http = cast(HttpForwarder, self._http)
        recovery = self.recovery
        if recovery is None:
            outcome = await http.exchange(request)
        else:
            key = functools.partial(fingerprint, self.name, version.encode(), body)
            recovery.refuse_poison(self.name, key)
            live, arrived = recovery.live(self.name), time.monotonic()
            deadline = recovery.deadline(timeout_us, arrived)
            send = functools.partial(http.exchange, request)
            if sequence is not None and self.journal is not None:
                outcome = await self.journal.run(
                    sequence, send, self._lost, _http_answered, deadline=deadline, key=key
                )
            else:
                outcome = await recovery.replay(
                    self.name, send, self._lost, deadline=deadline, key=key,
                    first=await send(), first_sent_live=live,
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
        sequence: SequenceFlags | None = None,
    ) -> Callable[[], None] | None:
        """``forward`` from callbacks: no task, no future (the front's fast path) unless
        the worker died under the request, or it belongs to a sequence kept in ``journal``.
        Returns what to call if the client leaves before ``done`` (None: nothing to do)."""
        if (sequence is not None and self.journal is not None) or self.cache is not None:
            call = self.forward(body, header_length, version, timeout_us, sequence)
            task = asyncio.get_running_loop().create_task(call)
            self._replays.add(task)
            task.add_done_callback(functools.partial(self._replayed, done))
            return None  # a sequence's step must reach its journal; a cached one is shared
        window = self.window
        if window is None or sequence is not None:
            self._send_now(body, header_length, version, done, timeout_us, sequence)
            return None

        def go(finish: Done) -> None:
            self._send_now(body, header_length, version, finish, timeout_us, None)

        return window.send(go, done, due_s(timeout_us), timeout_us)

    def _send_now(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        done: Done,
        timeout_us: int | None,
        sequence: SequenceFlags | None,
    ) -> None:
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
        context = contextvars.copy_context()  # the request's (its span), for a replay

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
            task = asyncio.get_running_loop().create_task(replay, context=context)
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
        sequence: SequenceFlags | None = None,
    ) -> bytes | Status:
        """A checked ``ModelInferRequest`` message to Triton's gRPC port as its bytes, and
        Triton's answer as it is; re-sent if its worker dies (``recovery``, with ``key``
        the request's poison fingerprint; a sequence's through ``journal``); answered
        from ``cache`` where it holds the same request's answer."""
        if self.cache is not None and sequence is None:
            sent = functools.partial(self._relay, body, key, timeout_us, metadata, None)
            return cast("bytes | Status", await self.cache.grpc("", body, sent))
        return await self._relay(body, key, timeout_us, metadata, sequence)

    async def _relay(
        self,
        body: bytes,
        key: Callable[[], bytes],
        timeout_us: int | None,
        metadata: tuple[tuple[str, Any], ...],
        sequence: SequenceFlags | None,
    ) -> bytes | Status:
        window = self.window
        if window is None or sequence is not None:
            return await self._relay_now(body, key, timeout_us, metadata, sequence)
        sent = functools.partial(self._relay_now, body, key, timeout_us, metadata)
        through = window.through(sent, due_s(timeout_us), self._replays, timeout_us)
        return cast("bytes | Status", await through)

    async def _relay_now(
        self,
        body: bytes,
        key: Callable[[], bytes],
        timeout_us: int | None,
        metadata: tuple[tuple[str, Any], ...],
        sequence: SequenceFlags | None = None,
    ) -> bytes | Status:
        parent = tracing.outgoing()
        if parent is not None:  # tritonserver's spans join the request's trace, under ours
            metadata = (*((k, v) for k, v in metadata if k != TRACEPARENT), (TRACEPARENT, parent))
        send = functools.partial(self._grpc().call, "ModelInfer", body, metadata)
        recovery = self.recovery
        if recovery is None:
            return await send()
        recovery.refuse_poison(self.name, key)
        live, arrived = recovery.live(self.name), time.monotonic()
        deadline = recovery.deadline(timeout_us, arrived)
        if sequence is not None and self.journal is not None:
            return await self.journal.run(
                sequence, send, self._relay_lost, _grpc_answered, deadline=deadline, key=key
            )
        outcome = await recovery.replay(
            self.name, send, self._relay_lost, deadline=deadline,
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
        sent = functools.partial(self._infer_now, inputs, priority, timeout_us, version)
        if self.window is None:
            return await sent()
        return await self.window.through(sent, due_s(timeout_us), self._replays, timeout_us)

    async def _infer_now(
        self, inputs: Mapping[str, np.ndarray], priority: int, timeout_us: int | None, version: str
    ) -> dict[str, np.ndarray]:
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

    async def responses(
        self, inputs: Mapping[str, np.ndarray]
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """A decoupled model's responses to ``inputs`` as tritonserver sends them (over a
        gRPC stream of their own: Triton serves decoupled models on streams only)."""
        self.spec.validate_inputs(inputs)
        async for response in self._grpc().stream(infer_request(self.name, inputs)):
            if response.error_message:
                raise from_grpc_code("UNKNOWN", response.error_message)  # a stream's: no code
            if response.infer_response.outputs:  # not the empty final response
                yield response_outputs(response.infer_response)

    def stream(
        self, message: Any, metadata: tuple[tuple[str, Any], ...] = ()
    ) -> AsyncIterator[Any]:
        """A checked request (a ``ModelInferRequest``) to a decoupled model: tritonserver's
        ``ModelStreamInferResponse`` messages as they come (the front's gRPC streams)."""
        return self._grpc().stream(message, metadata)

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


def _http_answered(outcome: Answer | ServekitError) -> bool:
    return not isinstance(outcome, ServekitError) and outcome[0] == 200


def _grpc_answered(outcome: bytes | Status) -> bool:
    return not isinstance(outcome, Status)


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
