"""A decoupled model's responses over HTTP as Server-Sent Events (beyond Triton, which
serves decoupled models over gRPC streams only)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import orjson

from ..errors import InvalidInput, ServekitError
from ..protocol.kserve import DecodedRequest, encode_response
from ..protocol.models import Decoupled
from .messages import Answer

__all__ = ["event_stream"]


def event_stream(name: str, model: Decoupled, request: DecodedRequest, accept: str) -> Answer:
    """One KServe JSON response per event as the model makes it, then ``event: end``; an
    error after the first event is sent as ``event: error`` with its message. Without
    ``Accept: text/event-stream`` the request is refused, as Triton refuses a unary call."""
    if "text/event-stream" not in accept:
        raise InvalidInput(
            f"model {name!r} is decoupled (it answers a request with any number of "
            "responses): ask for 'Accept: text/event-stream', or call it over a gRPC stream"
        )
    model.spec.validate_inputs(request.inputs)
    request = dataclasses.replace(request, binary_outputs=frozenset())

    async def events() -> AsyncIterator[bytes]:
        try:
            async for outputs in model.responses(request.inputs):
                payload, _ = encode_response(name, outputs, request)
                yield b"data: " + payload + b"\n\n"
        except ServekitError as exc:
            yield b"event: error\ndata: " + orjson.dumps({"error": str(exc)}) + b"\n\n"
            return
        yield b"event: end\ndata: {}\n\n"

    return 200, events(), {"content-type": "text/event-stream", "cache-control": "no-cache"}
