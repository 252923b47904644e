"""One HTTP request and its answer as servekit's handlers see them, whichever server
carries them (``h1``, or ASGI through ``asgi``)."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from ..errors import PayloadTooLarge

__all__ = ["Answer", "FastPath", "Handler", "HttpRequest", "Reply", "not_allowed"]

Reply = Callable[[int, bytes, Mapping[str, str]], None]
"""Answer the request: status, body, headers (content-length is added)."""
FastPath = Callable[[str, str, list[tuple[bytes, bytes]], bytes, Reply], bool | Callable[[], None]]
"""(method, path, headers as received with lower-case names, body, reply) -> whether it
took the request; one it takes must be answered through ``reply``, once, on the server's
loop. It may return, instead of True, what to call if the client leaves first."""


class HttpRequest:
    """One request as a handler sees it: header names lower-case, values decoded once."""

    __slots__ = ("_body", "headers", "limit", "method", "oversize", "path", "query")

    def __init__(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        *,
        query: bytes = b"",
        oversize: int = 0,
        limit: int = 0,
    ) -> None:
        self.method, self.path, self.headers, self._body = method, path, headers, body
        self.query, self.oversize, self.limit = query, oversize, limit

    @property
    def wire_path(self) -> str:
        """``path`` (decoded once by the server) percent-encoded again, as it goes on to
        tritonserver: a model named with a space or a ``%`` stays one name there."""
        return urllib.parse.quote(self.path, safe="/")

    @property
    def body(self) -> bytes:
        """The body; ``PayloadTooLarge`` when it was over the limit (read and dropped)."""
        if self.oversize:
            raise PayloadTooLarge(self.oversize, self.limit)
        return self._body


Answer = tuple[int, bytes | AsyncIterator[bytes], Mapping[str, str]]
"""Status, body and headers (the server adds content-length)."""
Handler = Callable[[HttpRequest], Awaitable[Answer]]
"""Answers one request; an exception is that request's 500 (a ``ServekitError``: its status)."""


def not_allowed(request: HttpRequest, *methods: str) -> Answer:
    """405 for a path served with other methods only, naming them in ``allow`` (as
    tritonserver answers, and as HTTP requires)."""
    error = json.dumps({"error": f"{request.method} not allowed on {request.path}"}).encode()
    return 405, error, {"content-type": "application/json", "allow": ", ".join(methods)}
