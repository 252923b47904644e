"""Forward a checked request to tritonserver's own HTTP port, body untouched.

servekit's front checks every request before Triton sees it; once checked, the cheapest
way on is the way it came: the same bytes, over a keep-alive HTTP/1.1 connection on
loopback, and Triton's answer passed back as it is. No tensors are rebuilt, re-encoded
or decoded again on the way. Connections are pooled per event loop; a pooled connection
the server closed meanwhile is replaced once, transparently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ..errors import ModelNotReady

__all__ = ["HttpForwarder"]

_PASSED_BACK = ("content-type", "inference-header-content-length", "retry-after")


class HttpForwarder:
    """POSTs bodies to ``http://host:port`` and returns (status, body, headers)."""

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None) -> None:
        hostport = url.removeprefix("http://").rstrip("/")
        self.host, _, port = hostport.rpartition(":")
        self.port = int(port)
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        """One request; raises ``ModelNotReady`` when tritonserver cannot be reached."""
        for attempt in range(2):
            reused = bool(self._idle)
            try:
                reader, writer = (
                    self._idle.pop()
                    if reused
                    else await asyncio.open_connection(self.host, self.port)
                )
            except OSError as exc:
                raise ModelNotReady(f"tritonserver is not answering: {exc}") from None
            try:
                result, keep = await self._exchange(reader, writer, path, body, headers)
            except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
                writer.close()
                if reused and attempt == 0:
                    continue  # the server had closed an idle connection: once more, fresh
                raise ModelNotReady(f"tritonserver dropped the connection: {exc}") from None
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()
            return result
        raise AssertionError("unreachable")

    async def _exchange(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> tuple[tuple[int, bytes, dict[str, str]], bool]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Length: {len(body)}\r\n{self._extra}"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "\r\n"
        )
        writer.write(head.encode("latin-1"))
        writer.write(body)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("closed before answering")
        try:
            status = int(status_line.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise ConnectionResetError(f"not an HTTP answer: {status_line[:80]!r}") from None
        answer: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, _, value = line.decode("latin-1").partition(":")
            answer[key.strip().lower()] = value.strip()
        if answer.get("transfer-encoding", "").lower() == "chunked":
            data = await self._chunked(reader)
        else:
            data = await reader.readexactly(int(answer.get("content-length", "0")))
        keep = answer.get("connection", "").lower() != "close"
        return (status, data, {k: v for k, v in answer.items() if k in _PASSED_BACK}), keep

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readline()

    async def close(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()
