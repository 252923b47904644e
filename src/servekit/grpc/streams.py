"""Triton's ``ModelStreamInfer`` beside the unary calls: how many of a stream's requests
are answered at once, a sequence's requests kept in the order sent, and the stream's
responses (an answer wrapped from its bytes, an error with the request's id)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from tritonclient.grpc import service_pb2

from .calls import Aborted, Raw, varint

__all__ = [
    "STREAM_IN_FLIGHT",
    "SequenceOrder",
    "request_sequence",
    "stream_error",
    "stream_response",
]

log = logging.getLogger("servekit.grpc.service")

STREAM_IN_FLIGHT = 256
"""Requests of one ``ModelStreamInfer`` stream answered at once; past it the stream's next
requests wait unread (and, past the connection's budget, so does its socket)."""


class SequenceOrder:
    """One stream's requests of one sequence answered one after the other, in the order
    sent, as Triton's stream keeps them: each request of a stream is its own concurrent
    call otherwise, and calls passed on to tritonserver may reach it in any order."""

    def __init__(self) -> None:
        self._last: dict[Any, asyncio.Future[None]] = {}

    async def answers(
        self, request: Any, make: Callable[[], AsyncIterator[Any]]
    ) -> AsyncIterator[Any]:
        """``make()``'s responses, after those of the same sequence sent before it; its
        place is taken when the first response is asked for (in the order the stream's
        calls start: before anything is awaited)."""
        sid = request_sequence(request)
        if not sid:
            async for response in make():
                yield response
            return
        before = self._last.get(sid)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last[sid] = mine
        try:
            if before is not None:
                await asyncio.wait([before])
            async for response in make():
                yield response
        finally:
            mine.set_result(None)
            if self._last.get(sid) is mine:
                del self._last[sid]


def request_sequence(request: Any) -> Any:
    """A ``ModelInferRequest``'s ``sequence_id`` parameter (0 without one)."""
    if "sequence_id" not in request.parameters:
        return 0
    value = request.parameters["sequence_id"]
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else 0


def stream_response(infer_response: bytes) -> Raw:
    """A ``ModelStreamInferResponse`` carrying ``infer_response`` (a serialized
    ``ModelInferResponse``), made from its bytes: field 2, length-delimited."""
    return Raw(b"\x12" + varint(len(infer_response)) + infer_response)


def stream_error(request: Any, exc: Exception) -> Any:
    """The stream response for a request that failed: its error (Triton's words for the
    call's status), the request's id and model."""
    if isinstance(exc, Aborted):
        message = exc.details
    else:
        log.error("unexpected error in a stream's request", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    return service_pb2.ModelStreamInferResponse(
        error_message=message,
        infer_response=service_pb2.ModelInferResponse(
            id=request.id, model_name=request.model_name, model_version=request.model_version
        ),
    )
