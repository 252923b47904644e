"""Triton's ``GRPCInferenceService`` (from the protocol definitions tritonclient ships) over a
``ModelRegistry``, on servekit's own HTTP/2 server (``grpc.h2``): what the native
runtime serves on its gRPC port.

Health, server and model metadata, model readiness, model configuration (Triton's
``ModelConfig`` message with the batching policy in force) and inference, with tensors
as typed contents or raw bytes (tritonclient sends raw). Requests are checked the way the
HTTP front checks them: shape claims against the request's size before anything is
allocated, then the model's signature. Errors map once through ``errors.grpc_code``.
``ModelStreamInfer`` (tritonclient's ``start_stream``) answers each request of a stream
as its own infer, concurrently, as each completes. With a model store (``servekit.store``) behind it, Triton's repository extension too:
the index with each model's state, and loads and unloads behind the control token.
Methods servekit does not serve here (shared memory, trace, logging, and repository
control without a store) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Protocol, cast

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .._version import __version__
from ..device import on_host
from ..errors import (
    CONTROL_TOKEN_HEADER,
    GRPC_HEADER_PREFIX,
    INFERENCE_TOKEN_HEADER,
    InvalidInput,
    ModelNotFound,
    RunnerError,
    ServekitError,
    Unauthenticated,
    grpc_code,
)
from ..protocol.kserve import (
    classify,
    parse_json,
)
from ..protocol.models import (
    DecoupledModel,
    ModelRegistry,
    RepositoryControl,
    conforms,
    input_device,
    lost_device,
)
from ..protocol.parameters import scheduling, sequence_flags
from ..protocol.routed import infer_answered
from ..protocol.shm import (
    NO_SHARED_MEMORY,
    SharedMemory,
    cuda_refusal,
)
from ..protocol.surface import EXTENSIONS, model_config, repository_index, statistics
from ..tracing import Tracing
from .calls import Method, each_answered, service_methods
from .h2 import GrpcH2Server
from .streams import STREAM_IN_FLIGHT, SequenceOrder, stream_error, stream_response
from .tensors import ModelInferRequest, decode_inputs, infer_response, parameter, request_parameters

__all__ = [
    "GrpcOnLoop",
    "GrpcService",
    "grpc_server",
]

log = logging.getLogger(__name__)

GRPC_TOKEN_KEY = GRPC_HEADER_PREFIX + INFERENCE_TOKEN_HEADER
"""Where a gRPC client puts the inference token (Triton's prefix for restricted protocols)."""
GRPC_CONTROL_KEY = GRPC_HEADER_PREFIX + CONTROL_TOKEN_HEADER
"""Where a gRPC client puts the control token (repository load and unload)."""


class GrpcService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The service; ``ready`` is the server's readiness (e.g. warm-up done)."""

    def __init__(
        self,
        models: ModelRegistry,
        *,
        ready: Callable[[], bool] = lambda: True,
        inference_token: str | None = None,
        control_token: str | None = None,
        on_failure: Callable[[str], None] = lambda _: None,
        shared_memory: SharedMemory | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.models, self._ready = models, ready
        self.tracing = tracing
        self._shm = shared_memory
        self._token = inference_token.encode() if inference_token else None
        self._control = control_token.encode() if control_token else None
        self._on_failure = on_failure

    def methods(self) -> Mapping[bytes, Method | None]:
        """The service's methods for ``GrpcH2Server``: ``ModelInfer`` reads its request
        with the tensors' bytes left in place (``ModelInferRequest``)."""
        descriptor = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        table = dict(service_methods(self, descriptor, service_pb2))
        for path, method in table.items():
            if method is not None and method.name == "ModelInfer":
                table[path] = Method(method.name, ModelInferRequest, method.handler)
        return table

    async def fail(self, context: Any, exc: BaseException) -> None:
        """End the call with ``exc``'s status (an unexpected error as INTERNAL, logged)."""
        if not isinstance(exc, ServekitError):
            log.exception("unexpected error in a gRPC call")
            exc = RunnerError(f"internal error: {type(exc).__name__}: {exc}")
        await context.abort(getattr(grpc.StatusCode, grpc_code(exc)), str(exc))

    async def ServerLive(self, request: Any, context: Any) -> Any:
        # A device lost in this process (native): live no more, so it is restarted.
        return service_pb2.ServerLiveResponse(live=lost_device() is None)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(
            name="servekit",
            version=__version__,
            extensions=[e for e in EXTENSIONS if e != "classification"],
        )

    async def ModelReady(self, request: Any, context: Any) -> Any:
        version = request.version or None
        ready = self._ready() and await self.models.is_ready(request.name, version)
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            model = await self.models.lookup(request.name)
        except ServekitError as exc:
            await self.fail(context, exc)
        lead = [-1] if model.spec.batched else []

        def tensors(items: Any) -> list[Any]:
            return [
                service_pb2.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.dtype.datatype, shape=lead + list(t.shape)
                )
                for t in items
            ]

        return service_pb2.ModelMetadataResponse(
            name=request.name,
            versions=list(model.versions or ("1",)),
            platform="servekit",
            inputs=tensors(model.spec.inputs),
            outputs=tensors(model.spec.outputs),
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            model = await self.models.lookup(request.name)
        except ServekitError as exc:
            await self.fail(context, exc)
        return service_pb2.ModelConfigResponse(config=model_config(request.name, model))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        from google.protobuf import json_format

        try:
            models = (
                {request.name: await self.models.lookup(request.name)}
                if request.name
                else dict(self.models.loaded())
            )
        except ServekitError as exc:
            await self.fail(context, exc)
        return json_format.ParseDict(statistics(models), service_pb2.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        index = service_pb2.RepositoryIndexResponse()
        if conforms(self.models, RepositoryControl):
            fields = ("name", "version", "state", "reason")
            for entry in self.models.index():
                if not request.ready or entry["state"] == "READY":
                    index.models.add(**{k: entry[k] for k in fields if k in entry})
            return index
        for entry in repository_index(self.models.loaded()):
            if not request.ready or entry["state"] == "READY":
                index.models.add(**entry)
        return index

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        control = await self._repository(context, "load")
        try:
            self._check(context, GRPC_CONTROL_KEY, self._control, CONTROL_TOKEN_HEADER)
            files = sorted(k for k in request.parameters if k.startswith("file:"))
            if files:
                raise InvalidInput(
                    f"repository load: model files in the request ({files}) are not taken; "
                    "put them in the store's root"
                )
            override = None
            if "config" in request.parameters:
                text = parameter(request.parameters["config"])
                where = "repository load: parameters.config"
                override = (
                    parse_json(text.encode(), where) if isinstance(text, str) and text else None
                )
                if override is not None and not isinstance(override, dict):
                    raise InvalidInput("repository load: parameters.config must be a JSON object")
            await control.load(request.model_name, override)
        except Exception as exc:
            await self.fail(context, exc)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        control = await self._repository(context, "unload")
        try:
            self._check(context, GRPC_CONTROL_KEY, self._control, CONTROL_TOKEN_HEADER)
            await control.unload(request.model_name)
        except Exception as exc:
            await self.fail(context, exc)
        return service_pb2.RepositoryModelUnloadResponse()

    async def _repository(self, context: Any, action: str) -> RepositoryControl:
        """The registry's repository control; UNIMPLEMENTED where models are fixed at start."""
        if not conforms(self.models, RepositoryControl):
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"repository {action}: this server's models are fixed at start (no [store])",
            )
        return cast(RepositoryControl, self.models)

    def authenticate(self, context: Any) -> None:
        """``Unauthenticated`` unless the call carries the inference token (when one is set)."""
        self._check(context, GRPC_TOKEN_KEY, self._token, INFERENCE_TOKEN_HEADER)

    @staticmethod
    def _check(context: Any, key: str, token: bytes | None, header: str) -> None:
        if token is None:
            return
        # Triton's key for a restricted protocol (prefixed), or the header's own name.
        keys = (key, key.removeprefix(GRPC_HEADER_PREFIX))
        given = next((v for k, v in context.invocation_metadata() or () if k.lower() in keys), "")
        if not hmac.compare_digest(given.encode() if isinstance(given, str) else given, token):
            raise Unauthenticated(f"missing or wrong {header} metadata")

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if self.tracing is None:
            return await self._infer(request, context)
        metadata = dict(context.invocation_metadata() or ())
        with self.tracing.request(request.model_name, "infer", metadata, protocol="grpc"):
            return await self._infer(request, context)

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        """Triton's trace extension: the settings (the server's, or a model's own), changed
        first where the request names any (behind the control token; an empty value
        clears a model's own)."""
        tracing = self.tracing
        if tracing is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "tracing is off: configure [server.tracing]"
            )
        assert tracing is not None
        try:
            if request.model_name:
                await self.models.lookup(request.model_name)
            if request.settings:
                self.check_control(context)
                changes = {
                    k: (list(v.value) if k == "trace_level" else v.value[0]) if v.value else None
                    for k, v in request.settings.items()
                }
                try:
                    setting = tracing.update(request.model_name, changes)
                except ValueError as exc:
                    raise InvalidInput(f"trace setting: {exc}") from None
            else:
                setting = tracing.setting(request.model_name)
        except Exception as exc:
            await self.fail(context, exc)
        response = service_pb2.TraceSettingResponse()
        for key, value in setting.to_triton().items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    async def _infer(self, request: Any, context: Any) -> Any:
        name = request.model_name
        try:
            self.authenticate(context)
            model = await self.models.lookup(name)
            wanted = request.model_version
            if wanted and not model.versioned and wanted not in model.versions:
                raise ModelNotFound(
                    f"model {name!r} has no version {wanted!r}; it has {list(model.versions)}"
                )
            try:
                regions = None if self._shm is None else self._shm.for_device(input_device(model))
                inputs = decode_inputs(request, context.size, regions=regions)
            except InvalidInput:
                self._on_failure(name)
                raise
            metadata = dict(context.invocation_metadata() or ())
            parameters = request_parameters(request)
            outputs, answered = await infer_answered(
                model, inputs, **scheduling(parameters), version=request.model_version,
                sticky_of=metadata.get, sequence=sequence_flags(parameters), name=name,
            )  # fmt: skip
            wanted = [o.name for o in request.outputs] or list(outputs)
            unknown = [n for n in wanted if n not in outputs]
            if unknown or len(set(wanted)) != len(wanted):
                raise InvalidInput(
                    f"requested outputs {wanted}: unknown or repeated; {name} has {sorted(outputs)}"
                )
            for o in request.outputs:  # Triton's classification extension
                k = (
                    parameter(o.parameters["classification"])
                    if "classification" in o.parameters
                    else 0
                )
                if k:
                    outputs[o.name] = classify(on_host(outputs[o.name]), int(k), o.name)
            # Inside: writing an output into its region can fail as the request's error.
            response = infer_response(request, outputs, wanted, answered, self._shm)
        except Exception as exc:
            await self.fail(context, exc)
        return response

    async def ModelStreamInfer(self, requests: Any, context: Any) -> AsyncGenerator[Any, None]:
        """Triton's stream: each request is answered as it completes, with its id; one that
        fails is answered with its ``error_message`` and the stream goes on."""
        order = SequenceOrder()
        answers = each_answered(
            requests,
            lambda request: order.answers(request, lambda: self.stream_answers(request, context)),
            STREAM_IN_FLIGHT,
        )
        async for request, outcome in answers:
            if isinstance(outcome, Exception):
                yield stream_error(request, outcome)
            else:
                yield stream_response(outcome.SerializeToString())

    async def stream_answers(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """One stream request's responses: a decoupled model's, as it makes them (each
        flagged ``triton_final_response`` false, then an empty final one where the request
        sets ``triton_enable_empty_final_response``), any other model's one answer."""
        try:
            model = await self.models.lookup(request.model_name)
        except ServekitError:
            model = None  # ModelInfer names what is wrong
        if not isinstance(model, DecoupledModel):
            yield await self.ModelInfer(request, context)
            return
        final_empty = False
        try:
            self.authenticate(context)
            parameters = request_parameters(request)
            final_empty = parameters.get("triton_enable_empty_final_response") is True
            inputs = decode_inputs(request, regions=self._shm)
            wanted = [o.name for o in request.outputs]
            async for outputs in model.responses(inputs):
                yield infer_response(
                    request, outputs, wanted or list(outputs), "1", self._shm, final=False
                )
        except Exception as exc:
            await self.fail(context, exc)
        if final_empty:
            yield infer_response(request, {}, [], "1", final=True)

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = service_pb2.SystemSharedMemoryStatusResponse()
        try:
            for entry in self._shared_memory(context).status(request.name or None):
                response.regions[entry["name"]].CopyFrom(
                    service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**entry)
                )
        except Exception as exc:
            await self.fail(context, exc)
        return response

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        try:
            self._shared_memory(context).register(
                request.name, request.key, request.offset, request.byte_size
            )
        except Exception as exc:
            await self.fail(context, exc)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        try:
            self._shared_memory(context).unregister(request.name or None)
        except Exception as exc:
            await self.fail(context, exc)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    def check_control(self, context: Any) -> None:
        """``Unauthenticated`` unless the call carries the control token (when one is set)."""
        self._check(context, GRPC_CONTROL_KEY, self._control, CONTROL_TOKEN_HEADER)

    def _shared_memory(self, context: Any) -> SharedMemory:
        """The server's regions, for a call that carries the control token (Triton's
        shared-memory APIs are control APIs); refused where none are taken."""
        self.check_control(context)
        if self._shm is None:
            raise InvalidInput(f"shared memory {NO_SHARED_MEMORY}")
        return self._shm

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = service_pb2.CudaSharedMemoryStatusResponse()
        if cuda_refusal(self._shm) is not None:
            return response  # none registered
        try:
            for entry in self._shared_memory(context).status(request.name or None, "cuda"):
                response.regions[entry["name"]].CopyFrom(
                    service_pb2.CudaSharedMemoryStatusResponse.RegionStatus(**entry)
                )
        except Exception as exc:
            await self.fail(context, exc)
        return response

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._cuda_served(context, "CudaSharedMemoryRegister")
        try:
            self._shared_memory(context).register_cuda(
                request.name, bytes(request.raw_handle), request.device_id, request.byte_size
            )
        except Exception as exc:
            await self.fail(context, exc)
        return service_pb2.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        try:
            self.check_control(context)
            if cuda_refusal(self._shm) is None:  # else none registered, none left (Triton's OK)
                self._shared_memory(context).unregister(request.name or None, "cuda")
        except Exception as exc:
            await self.fail(context, exc)
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    async def _cuda_served(self, context: Any, call: str) -> None:
        """Refused by name (as on HTTP) where this server maps no regions or sees no GPU."""
        refusal = cuda_refusal(self._shm)
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{call}: {refusal}")


class Servicer(Protocol):
    """What servekit's gRPC server serves: a table of unary methods (``GrpcService``)."""

    def methods(self) -> Mapping[bytes, Method | None]: ...


def grpc_server(
    service: Servicer, host: str, port: int, max_message_bytes: int, **limits: Any
) -> GrpcH2Server:
    """servekit's gRPC server with the service on ``host:port`` (start it on a running loop);
    ``limits``: its connection limits (``GrpcH2Server``'s keywords)."""
    return GrpcH2Server(service.methods(), host, port, max_message_bytes, **limits)


class GrpcOnLoop:
    """The service's server on another server's event loop: ``start`` and ``stop`` are that
    server's ``on_start`` and ``on_exit`` hooks (one loop for HTTP and gRPC)."""

    def __init__(
        self,
        service: Servicer,
        host: str,
        port: int,
        max_message_bytes: int,
        exit_s: float,
        **limits: Any,
    ) -> None:
        self._args = (service, host, port, max_message_bytes)
        self._limits = limits
        self._exit_s = exit_s
        self._server: GrpcH2Server | None = None

    async def start(self) -> None:
        self._server = grpc_server(*self._args, **self._limits)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(self._exit_s)
            self._server = None
