"""What the load generator talks to: a KServe v2 endpoint (HTTP or gRPC) or an in-process model.

Every target has ``await send()`` (one request with the prepared payload) and ``close()``;
remote errors raise ``ServekitError`` subclasses, so the generator counts them the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ..errors import ModelNotFound, ModelNotReady, ServekitError

__all__ = ["BatcherTarget", "RemoteTarget", "RunnerTarget", "Target", "open_target"]


class Target(Protocol):
    name: str

    async def send(self) -> None: ...

    async def close(self) -> None: ...


class RemoteTarget:
    """A KServe v2 server over HTTP or gRPC (tritonclient's asyncio clients).

    The request is built once and reused, since the payload never changes; with
    ``shared_memory`` it is written once into a registered system shared-memory region
    (same host only; ``access_token`` for servers that restrict that API, as PyTriton does).
    """

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
        if shared_memory:
            self._registrar = Client(url, shared_memory=True, access_token=access_token)
            self._prepared = self._registrar.prepare(self.inputs)
        else:
            self._prepared = self._client.prepare(self.inputs, binary=binary)

    async def check(self) -> None:
        """Fail fast and clearly: the server must answer and know the model."""
        try:
            await self.send()
        except ModelNotFound:
            raise
        except ModelNotReady as exc:
            raise ModelNotReady(f"cannot reach {self.url}: {exc}") from None

    async def send(self) -> None:
        await self._client.infer_prepared(self.model, self._prepared)

    async def close(self) -> None:
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
