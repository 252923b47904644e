"""What the load generator talks to: a KServe v2 endpoint (HTTP or gRPC) or an in-process model.

Every target has ``await send()`` (one request with the prepared payload) and ``close()``;
remote errors raise ``ServekitError`` subclasses, so the generator counts them the same way.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ..errors import ServekitError, ServerUnreachable

__all__ = ["BatcherTarget", "RemoteTarget", "RunnerTarget", "Target", "open_target"]


class Target(Protocol):
    name: str

    async def send(self) -> None: ...

    async def close(self) -> None: ...


class RemoteTarget:
    """A KServe v2 server over HTTP or gRPC.

    The request is built once and reused, since the payload never changes. Over HTTP the
    body itself is encoded once (binary tensors, or JSON with ``binary=False``) and each
    request only posts those bytes, as wrk would; over gRPC tritonclient's asyncio client
    sends the prepared inputs. With ``shared_memory`` the inputs are written once into a
    registered system shared-memory region (same host only; ``access_token`` for servers
    that restrict that API, as PyTriton does).
    """

    remote = True

    def __init__(
        self,
        url: str,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        shared_memory: bool = False,
        access_token: str | None = None,
        binary: bool = True,
    ) -> None:
        from ..client import AsyncClient, Client

        self.name = f"{url} {model}{' (shm)' if shared_memory else ''}"
        self.url, self.model, self.inputs = url, model, dict(inputs)
        self._client = AsyncClient(url)
        self._registrar = None
        self._session: Any = None
        if shared_memory:
            self._registrar = Client(url, shared_memory=True, access_token=access_token)
            self._prepared = self._registrar.prepare(self.inputs)
        else:
            self._prepared = self._client.prepare(self.inputs, binary=binary)
        self._body: bytes | None = None
        if url.startswith("http://"):
            import tritonclient.http as th

            body, json_size = th.InferenceServerClient.generate_request_body(self._prepared)
            self._body = body
            self._headers = {
                "Content-Type": "application/octet-stream" if json_size else "application/json"
            }
            if json_size is not None:
                self._headers["Inference-Header-Content-Length"] = str(json_size)
            self._endpoint = f"{url}/v2/models/{model}/infer"

    async def check(self) -> None:
        """Fail fast and clearly: the server must answer and know the model."""
        try:
            await self.send()  # the very request the measurement sends
        except ServerUnreachable as exc:
            raise ServerUnreachable(f"{exc} (is the server up at {self.url}?)") from None

    async def send(self) -> None:
        if self._body is None:
            await self._client.infer_prepared(self.model, self._prepared)
            return
        import aiohttp

        from ..errors import from_http_status

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            # aiohttp streams a body over 1 MB from a file object (and warns on raw bytes).
            body = self._body if len(self._body) <= 1 << 20 else io.BytesIO(self._body)
            async with self._session.post(self._endpoint, data=body, headers=self._headers) as r:
                payload = await r.read()
                if r.status != 200:
                    raise from_http_status(r.status, payload[:500].decode("utf-8", "replace"))
        except aiohttp.ClientError as exc:
            raise ServerUnreachable(f"cannot reach {self.url}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._client.close()
        if self._registrar is not None:
            self._registrar.close()


class BatcherTarget:
    """An in-process ``Batcher`` (servekit's own dynamic batching, no network)."""

    def __init__(
        self, batcher: Any, inputs: Mapping[str, np.ndarray], name: str = "batcher"
    ) -> None:
        self.name, self.batcher, self.inputs = name, batcher, dict(inputs)

    async def check(self) -> None:
        await self.send()

    async def send(self) -> None:
        await self.batcher.infer(self.inputs)

    async def close(self) -> None:
        pass


class RunnerTarget:
    """A Runner or Pipeline called directly, one request per call, on ``threads`` threads."""

    def __init__(
        self, runner: Any, inputs: Mapping[str, np.ndarray], threads: int = 1, name: str = "raw"
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.name, self.runner, self.inputs = name, runner, dict(inputs)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="servekit-bench")

    async def check(self) -> None:
        await self.send()

    async def send(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.runner.infer, self.inputs)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)


def open_target(
    url: str,
    model: str,
    inputs: Mapping[str, np.ndarray],
    *,
    shared_memory: bool = False,
    access_token: str | None = None,
    binary: bool = True,
) -> RemoteTarget:
    """A remote target for ``http://host:port`` or ``grpc://host:port``; ``binary=False``
    sends JSON (HTTP only), as wrk or curl would."""
    if not url.startswith(("http://", "grpc://")):
        raise ServekitError(f"target url must start with http:// or grpc://, got {url!r}")
    return RemoteTarget(
        url, model, inputs, shared_memory=shared_memory, access_token=access_token, binary=binary
    )
