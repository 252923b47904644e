"""The response cache on the Triton runtimes, in servekit's front (``response_cache``).

tritonserver's own cache keys a request by the model, version, input names and input bytes
only, so requests with the same bytes in another shape or datatype share an answer. Here
the key is the request exactly as it came, checked (its protocol, and over HTTP its JSON
header's length, beside the model, the version and what the served files are: every
input's name, datatype, shape and bytes, the parameters and the outputs asked for are all
in those bytes), and the entry is tritonserver's answer exactly as it went back (a 200
only); a hit is compared in full with the stored request before it is returned, as on
every runtime (``servekit.cache``). Over HTTP and gRPC the same request is two entries:
the front passes bytes on, and never decodes an answer to share it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..cache import Query, ResponseCache

__all__ = ["FrontCache"]

Answer = tuple[int, bytes, dict[str, str]]


class FrontCache:
    """One model's answers in ``cache``; ``identity()`` names the files it serves now."""

    def __init__(self, cache: ResponseCache, model: str, identity: Callable[[], str]) -> None:
        self.cache, self.model, self.identity = cache, model, identity

    def _query(self, protocol: bytes, version: str, body: bytes, length: int | None) -> Query:
        request = protocol + struct.pack("<q", -1 if length is None else length) + body
        return Query(self.model, version or "1", self.identity(), request, "", ())

    async def http(
        self,
        version: str,
        body: bytes,
        header_length: int | None,
        send: Callable[[], Awaitable[Answer]],
    ) -> Answer:
        """The answer kept for exactly this request, else ``send``'s (kept if a 200)."""
        query = self._query(b"http", version, body, header_length)
        kept = await self.cache.lookup(query)
        if kept is not None:
            headers = json.loads(kept["headers"].tobytes())
            return 200, kept["body"].tobytes(), headers
        answer = await send()
        status, payload, headers = answer
        if status == 200:
            await self.cache.insert(query, {
                "body": np.frombuffer(payload, np.uint8),
                "headers": np.frombuffer(json.dumps(dict(headers)).encode(), np.uint8),
            })  # fmt: skip
        return answer

    async def grpc(self, version: str, message: bytes, send: Callable[[], Awaitable[Any]]) -> Any:
        """The ``ModelInfer`` answer kept for exactly this request message, else ``send``'s
        (kept when it is an answer, not a status)."""
        query = self._query(b"grpc", version, message, None)
        kept = await self.cache.lookup(query)
        if kept is not None:
            return kept["body"].tobytes()
        answer = await send()
        if isinstance(answer, bytes):
            await self.cache.insert(query, {"body": np.frombuffer(answer, np.uint8)})
        return answer
