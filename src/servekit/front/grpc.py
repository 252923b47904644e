"""A lean KServe v2 gRPC caller: ``ModelInfer`` with raw tensor bytes on a ``grpc.aio`` stub.

What ``ForwardedModel.infer`` calls tritonserver with (an infer from Python code with
tensors in hand; HTTP requests through the front pass their bytes on instead,
``http.forward``). It builds the request message directly from numpy arrays (one
``tobytes`` per tensor) and reads outputs straight from ``raw_output_contents``, where
tritonclient's asyncio client builds and parses Python objects per tensor and per call.
``call`` passes any method's request message on as its bytes over servekit's own lean
HTTP/2 client (``grpc.h2client``; the front's public gRPC port, ``front.relay``).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..errors import GRPC_HEADER_PREFIX, ModelNotReady, from_grpc_code
from ..grpc.h2client import H2Client
from ..protocol.kserve import tensor_from_raw, tensor_to_raw

__all__ = ["GrpcForwarder", "Status", "infer_request", "response_outputs"]

SERVICE = "/inference.GRPCInferenceService/"


class Status(NamedTuple):
    """A call's status other than OK, as tritonserver gave it (``code``: a grpc.StatusCode)."""

    code: Any
    details: str


def _status_code(number: int) -> Any:
    """The grpc.StatusCode numbered ``number`` (UNKNOWN for a number gRPC does not define)."""
    import grpc

    return next((c for c in grpc.StatusCode if c.value[0] == number), grpc.StatusCode.UNKNOWN)


def infer_request(
    model: str,
    inputs: Mapping[str, np.ndarray],
    priority: int = 0,
    timeout_us: int | None = None,
    version: str = "",
) -> Any:
    """A ``ModelInferRequest`` of ``inputs``, each tensor's bytes raw."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    for name, array in inputs.items():
        datatype, raw = tensor_to_raw(array)
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(raw)
    if priority:
        request.parameters["priority"].uint64_param = priority
    if timeout_us is not None:
        request.parameters["timeout"].int64_param = timeout_us
    return request


def response_outputs(response: Any) -> dict[str, np.ndarray]:
    """A ``ModelInferResponse``'s outputs as arrays."""
    return {
        out.name: tensor_from_raw(
            out.name, out.datatype, list(out.shape), memoryview(raw), math.prod(out.shape)
        )
        for out, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


class GrpcForwarder:
    """``infer`` on a Triton gRPC endpoint; one channel, made on first use on the running loop."""

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        max_message_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self.url = url.removeprefix("grpc://")
        self._metadata = tuple((GRPC_HEADER_PREFIX + k, v) for k, v in (headers or {}).items())
        self._max = max_message_bytes
        self._channel: Any = None
        self._stub: Any = None
        self._h2: H2Client | None = None

    def _connect(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        options = [
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
        ]
        self._channel = grpc.aio.insecure_channel(self.url, options=options)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        """The model's outputs, or the servekit error its gRPC status stands for."""
        import grpc

        if self._stub is None:
            self._connect()
        request = infer_request(model, inputs, priority, timeout_us, version)
        try:
            response = await self._stub.ModelInfer(request, metadata=self._metadata or None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or ""):
                raise ModelNotReady(f"cannot reach {self.url}: {exc.details()}") from None
            raise from_grpc_code(exc.code().name, exc.details() or "") from None
        return response_outputs(response)

    async def stream(
        self, request: Any, metadata: tuple[tuple[str, Any], ...] = ()
    ) -> AsyncIterator[Any]:
        """A decoupled model's ``ModelStreamInferResponse`` messages to one request (a
        ``ModelInferRequest``), over a ``ModelStreamInfer`` stream of its own, until
        Triton's final flag; leaving early cancels the call, which tritonserver passes on
        to the model."""
        import grpc

        if self._stub is None:
            self._connect()
        call = self._stub.ModelStreamInfer(metadata=(self._metadata + metadata) or None)
        try:
            await call.write(request)
            await call.done_writing()
            async for response in call:
                yield response
                final = response.infer_response.parameters.get("triton_final_response")
                if response.error_message or (final is not None and final.bool_param):
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise ModelNotReady(f"cannot reach {self.url}: {exc.details()}") from None
            raise from_grpc_code(exc.code().name, exc.details() or "") from None
        finally:
            call.cancel()

    async def call(
        self, method: str, body: bytes, metadata: tuple[tuple[str, Any], ...] = ()
    ) -> bytes | Status:
        """``method``'s answer message from tritonserver to a request message, both as their
        bytes (nothing decoded, ``H2Client``), or the status it ended with."""
        if self._h2 is None:
            host, port = self.url.rsplit(":", 1)
            self._h2 = H2Client(host, int(port))
        code, details, reply = await self._h2.call(
            SERVICE + method, body, self._metadata + metadata
        )
        return reply if code == 0 else Status(_status_code(code), details)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
        if self._h2 is not None:
            await self._h2.close()
            self._h2 = None
