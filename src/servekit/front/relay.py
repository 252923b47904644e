"""The front's public gRPC port on the Triton runtimes: servekit's gRPC server
(``grpc.h2``, with its connection budgets) in front of tritonserver's gRPC on loopback,
so that no client speaks HTTP/2 to tritonserver itself.

Calls go on as their message bytes (``GrpcForwarder.call``) with the client's metadata,
and tritonserver's answer comes back as it is; tritonserver checks the control token
on its restricted APIs (shared memory, repository, trace, logging). An infer is parsed
once and checked as the HTTP front checks it (shape claims against the message's size,
then the model's signature) before its bytes go on, and re-sent if its worker dies
(``ForwardedModel.relay``). A routed model (a traffic split) takes servekit's full path
(``GrpcService``), as do liveness and readiness, which are the front's. A
``ModelStreamInfer`` stream is answered request by request, each as the infer above
(checked, relayed as its bytes, re-sent on a dead stub), its answer wrapped as a stream
response without being decoded.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from ..errors import GRPC_HEADER_PREFIX, INFERENCE_TOKEN_HEADER, InvalidInput, ServekitError
from ..grpc.calls import Method, Raw, each_answered, once, service_methods
from ..grpc.service import GRPC_TOKEN_KEY, GrpcService
from ..grpc.streams import STREAM_IN_FLIGHT, SequenceOrder, stream_error, stream_response
from ..grpc.tensors import decode_inputs, output_refs, request_parameters
from ..protocol.models import decoupled_refusal
from ..protocol.parameters import scheduling, sequence_flags, unsequenced
from ..protocol.shm import DECLARED, SharedMemory, check_output_room, check_registration
from ..recovery import tensors_key
from .forwarded import ForwardedModel
from .grpc import GrpcForwarder, Status
from .models import PyTritonModels, TritonModels

__all__ = ["GrpcRelay"]

_NOT_PASSED = frozenset({"content-type", "te", "user-agent", "host"})
"""Request headers that belong to the client's own HTTP/2 call, not to its metadata."""
_BY_MODEL = {
    "ModelReady": service_pb2.ModelReadyRequest,
    "ModelMetadata": service_pb2.ModelMetadataRequest,
    "ModelConfig": service_pb2.ModelConfigRequest,
    "ModelStatistics": service_pb2.ModelStatisticsRequest,
}
"""Calls about one model (``name``): servekit answers them for a routed or unknown model
(statistics: only for a model the front serves itself; tritonserver has the others')."""
_CONTROL = ("RepositoryModelLoad", "RepositoryModelUnload")


class GrpcRelay:
    """Triton's ``GRPCInferenceService`` as the front serves it (``methods`` for ``h2``).

    ``service``: servekit's own service over the same registry, for what the front
    answers itself; ``upstream``: tritonserver's private gRPC port."""

    def __init__(
        self,
        service: GrpcService,
        registry: TritonModels | PyTritonModels,
        upstream: str,
        *,
        on_failure: Callable[[str], None] = lambda _: None,
        mirror: SharedMemory | None = None,
    ) -> None:
        self.service, self.registry = service, registry
        self.upstream = GrpcForwarder(upstream)
        self._on_failure = on_failure
        self.mirror = mirror
        """The front's own map of the system regions tritonserver holds, for the models
        the front serves itself (PyTriton's ``local``); None where it serves none."""

    def methods(self) -> Mapping[bytes, Method | None]:
        descriptor = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        table = dict(service_methods(self.service, descriptor, service_pb2))
        for path, method in table.items():
            if method is None or method.name in ("ServerLive", "ServerReady"):
                continue
            if method.name == "ModelInfer":
                table[path] = Method(method.name, Raw, self._infer)
            elif method.name == "ModelStreamInfer":
                table[path] = Method(method.name, Raw, self._stream, streaming=True)
            elif method.name in _BY_MODEL:
                handler = functools.partial(self._about_model, method.name, method.handler)
                table[path] = Method(method.name, Raw, handler)
            elif method.name.startswith("Repository") and isinstance(self.registry, PyTritonModels):
                continue  # PyTriton's models are fixed at start: servekit says so
            elif "SharedMemory" in method.name:
                handler = functools.partial(self._shared_memory, method.name)
                table[path] = Method(method.name, Raw, handler)
            elif method.name == "TraceSetting" and self.service.tracing is not None:
                table[path] = Method(method.name, Raw, self._trace_setting)
            elif method.name in _CONTROL and isinstance(self.registry, TritonModels):
                handler = functools.partial(self._control, method.name)
                table[path] = Method(method.name, Raw, handler)
            else:
                table[path] = Method(method.name, Raw, functools.partial(self._pass, method.name))
        return table

    async def aclose(self) -> None:
        await self.upstream.close()

    @staticmethod
    def _metadata(context: Any, *drop: str) -> tuple[tuple[str, Any], ...]:
        return tuple(
            (k, v)
            for k, v in context.invocation_metadata()
            if k not in _NOT_PASSED and not k.startswith("grpc-") and k not in drop
        )

    @staticmethod
    async def _answer(context: Any, outcome: bytes | Status) -> Raw:
        if isinstance(outcome, Status):
            await context.abort(outcome.code, outcome.details)
        return Raw(outcome)  # type: ignore[arg-type]

    async def _pass(self, method: str, request: Raw, context: Any) -> Raw:
        """tritonserver's answer, as it is."""
        outcome = await self.upstream.call(method, request.data, self._metadata(context))
        return await self._answer(context, outcome)

    async def _control(self, method: str, request: Raw, context: Any) -> Raw:
        """A load or unload passed on, or refused as the client's (FAILED_PRECONDITION, not
        tritonserver's UNAVAILABLE, which asks for a retry) where it cannot work."""
        assert isinstance(self.registry, TritonModels)
        why = self.registry.control_refused()
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{method}: {why}")
        return await self._pass(method, request, context)

    async def _shared_memory(self, method: str, request: Raw, context: Any) -> Raw:
        """Triton's shared-memory APIs: the client's control token checked here, a
        registration checked as native checks it (a missing key, one too small, a path or
        one of the server's own regions is the client's INVALID_ARGUMENT, where
        tritonserver answers INTERNAL), then passed on with the front's own control
        metadata: tritonserver maps and reads the regions. A system region is mapped by
        the front too where it serves models itself (``mirror``), as long as tritonserver
        holds it."""
        mirrored: str | None = None
        try:
            self.service.check_control(context)
            if method == "SystemSharedMemoryRegister":
                kind = service_pb2.SystemSharedMemoryRegisterRequest
                m = await self._parse(kind, request, context)
                check_registration(m.name, m.key, m.offset, m.byte_size)
                if self.mirror is not None:
                    self.mirror.register(m.name, m.key, m.offset, m.byte_size)
                    mirrored = m.name
        except ServekitError as exc:
            await self.service.fail(context, exc)
        control = tuple(
            (GRPC_HEADER_PREFIX + k, v) for k, v in self.registry.control_headers.items()
        )
        try:
            outcome = await self.upstream.call(method, request.data, control)
        except BaseException:
            if mirrored is not None and self.mirror is not None:
                self.mirror.unregister(mirrored)
            raise
        if self.mirror is not None and isinstance(outcome, Status) and mirrored is not None:
            self.mirror.unregister(mirrored)  # tritonserver refused it
        elif self.mirror is not None and method == "SystemSharedMemoryUnregister":
            kind = service_pb2.SystemSharedMemoryUnregisterRequest
            if not isinstance(outcome, Status):
                self.mirror.unregister((await self._parse(kind, request, context)).name or None)
        return await self._answer(context, outcome)

    async def _trace_setting(self, request: Raw, context: Any) -> Any:
        """The front's trace settings (servekit's service checks the control token and
        answers); a change goes on to tritonserver with the front's own control metadata,
        so its sampling and level follow the front's."""
        message = await self._parse(service_pb2.TraceSettingRequest, request, context)
        answer = await self.service.TraceSetting(message, context)
        if message.settings and self.registry.serves(message.model_name):
            control = tuple(
                (GRPC_HEADER_PREFIX + k, v) for k, v in self.registry.control_headers.items()
            )
            outcome = await self.upstream.call("TraceSetting", request.data, control)
            if isinstance(outcome, Status):
                await context.abort(outcome.code, f"tritonserver: {outcome.details}")
        return answer

    async def _model(self, name: str) -> ForwardedModel | None:
        """The model ``name`` names if tritonserver answers for it as it is; None where
        servekit does (a routed model, or one the registry does not have)."""
        model = self.registry.peek(name)
        if model is None:
            try:
                model = await self.registry.lookup(name)  # type: ignore[assignment]
            except ServekitError:
                return None
        return model if isinstance(model, ForwardedModel) else None

    @staticmethod
    async def _parse(kind: Any, request: Raw, context: Any) -> Any:
        """The message, or INVALID_ARGUMENT naming what it should have been."""
        try:
            return kind.FromString(request.data)
        except DecodeError:
            await context.abort(3, f"the request is not a {kind.__name__} message")

    async def _about_model(
        self,
        method: str,
        own: Callable[[Any, Any], Awaitable[Any]],
        request: Raw,
        context: Any,
    ) -> Any:
        message = await self._parse(_BY_MODEL[method], request, context)
        if not self.registry.serves(message.name) or (
            method != "ModelStatistics" and await self._model(message.name) is None
        ):
            return await own(message, context)
        return await self._pass(method, request, context)

    async def _infer(self, request: Raw, context: Any, message: Any = None) -> Any:
        if message is None:
            message = await self._parse(service_pb2.ModelInferRequest, request, context)
        name = message.model_name
        model = await self._model(name)
        if model is None:  # routed (or unknown: servekit names what the registry has)
            return await self.service.ModelInfer(message, context)
        tracer = self.service.tracing
        if tracer is None:
            return await self._relayed(request, context, message, model)
        metadata = dict(context.invocation_metadata() or ())
        with tracer.request(name, "infer", metadata, protocol="grpc"):
            return await self._relayed(request, context, message, model)

    async def _relayed(self, request: Raw, context: Any, message: Any, model: Any) -> Any:
        name = message.model_name
        try:
            inputs, timeout_us, sequence = self._check(request, context, message, model)
            if model.decoupled:
                raise decoupled_refusal(name)
            outcome = await model.relay(
                request.data,
                tensors_key(name, message.model_version, inputs),
                timeout_us=timeout_us,
                metadata=self._metadata(context, GRPC_TOKEN_KEY, INFERENCE_TOKEN_HEADER),
                sequence=sequence,
            )
        except ServekitError as exc:
            await self.service.fail(context, exc)
        return await self._answer(context, outcome)

    def _check(
        self, request: Raw, context: Any, message: Any, model: ForwardedModel
    ) -> tuple[Any, int | None, Any]:
        """An infer checked as the HTTP front checks it: its inputs, its timeout and its
        sequence (refused where the model has no sequence batcher)."""
        self.service.authenticate(context)
        name = message.model_name
        try:
            inputs = decode_inputs(message, len(request.data), DECLARED)
            rows = model.spec.validate_inputs(inputs)
            check_output_room(model.spec, rows, output_refs(message))
            parameters = request_parameters(message)
            timeout_us = scheduling(parameters).get("timeout_us")
            sequence = sequence_flags(parameters)
            if sequence is not None and not model.sequenced:
                raise unsequenced(name, sequence)
        except InvalidInput:
            self._on_failure(name)
            raise
        return inputs, timeout_us, sequence

    async def _answers(self, request: Raw, context: Any, message: Any) -> AsyncIterator[Any]:
        """One stream request's responses: a decoupled model's as tritonserver sends them
        (over a stream of their own; a client that leaves cancels it), else the infer's."""
        model = await self._model(message.model_name)
        if model is None:  # servekit answers it (a routed model; one the front serves itself)
            async for response in self.service.stream_answers(message, context):
                yield response
            return
        if not model.decoupled:
            yield await self._infer(request, context, message)
            return
        try:
            self._check(request, context, message, model)
        except ServekitError as exc:
            await self.service.fail(context, exc)
        metadata = self._metadata(context, GRPC_TOKEN_KEY, INFERENCE_TOKEN_HEADER)
        async for response in model.stream(message, metadata):
            yield response

    async def _stream(
        self, requests: AsyncIterator[Raw], context: Any
    ) -> AsyncGenerator[Any, None]:
        """Each request of the stream as its own infer (``_infer``), answered as it completes
        (a sequence's in the order sent); a decoupled model's responses as they come."""
        order = SequenceOrder()

        def answer(request: Raw) -> AsyncIterator[Any]:
            try:
                message = service_pb2.ModelInferRequest.FromString(request.data)
            except DecodeError:
                return once(self._infer(request, context))  # named there
            return order.answers(message, lambda: self._answers(request, context, message))

        answers = each_answered(requests, answer, STREAM_IN_FLIGHT)
        async for request, outcome in answers:
            if isinstance(outcome, Exception):
                try:
                    message = service_pb2.ModelInferRequest.FromString(request.data)
                except DecodeError:
                    message = service_pb2.ModelInferRequest()
                yield stream_error(message, outcome)
            elif isinstance(outcome, Raw):
                yield stream_response(outcome.data)
            elif isinstance(outcome, service_pb2.ModelStreamInferResponse):
                yield outcome  # a decoupled model's, as tritonserver sent it
            else:  # servekit answered it (a routed model)
                yield stream_response(outcome.SerializeToString())
