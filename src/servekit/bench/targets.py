"""What the load generator talks to: a KServe v2 endpoint (HTTP or gRPC) or an in-process model.

Every target has ``await send()`` (one request with the prepared payload) and ``close()``;
remote errors raise ``ServekitError`` subclasses, so the generator counts them the same way.
``send(timeout_us=...)`` carries the client's timeout to the server (the KServe ``timeout``
parameter, over HTTP and gRPC); a send cancelled when the client gives up closes its HTTP
connection or cancels its gRPC call.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import ServekitError, ServerUnreachable

__all__ = [
    "BatcherTarget",
    "RemoteTarget",
    "RunnerTarget",
    "Sequences",
    "StreamTarget",
    "Target",
    "open_target",
]


Payloads = Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]
"""One request's inputs, or several requests' sent in turn."""


def _payloads(inputs: Payloads) -> list[dict[str, np.ndarray]]:
    payloads = [dict(inputs)] if isinstance(inputs, Mapping) else [dict(p) for p in inputs]
    if not payloads:
        raise ServekitError("no inputs to send: give at least one payload")
    return payloads


class Target(Protocol):
    name: str

    async def send(self, timeout_us: int | None = None) -> None:
        """One request; ``timeout_us``: how long its client waits (the server may drop it
        after that)."""
        ...

    async def close(self) -> None: ...


class Sequences:
    """Each load-generator worker's sequences of ``length`` requests (perf_analyzer's
    ``--sequence-length``): the flags of its next request, a new unique id after each END."""

    def __init__(self, length: int) -> None:
        import itertools
        import random

        self.length = length
        self._ids = itertools.count(random.randrange(1, 1 << 40))
        self._at: dict[object, tuple[int, int]] = {}  # worker -> (sequence id, next step)

    def next(self) -> dict[str, Any]:
        """``sequence_id``, ``sequence_start``, ``sequence_end`` for the calling task's next
        request (empty without sequences)."""
        if not self.length:
            return {}
        worker = asyncio.current_task()
        sid, step = self._at.get(worker) or (next(self._ids), 0)
        end = step == self.length - 1
        self._at[worker] = (next(self._ids), 0) if end else (sid, step + 1)
        return {"sequence_id": sid, "sequence_start": step == 0, "sequence_end": end}


class RemoteTarget:
    """A KServe v2 server over HTTP or gRPC.

    Each request is built once and reused: ``inputs`` is one payload or several, sent in
    turn (``--input-data`` with several entries). Over HTTP each body is encoded once (binary tensors, or JSON with ``binary=False``) and each
    request only posts those bytes, as wrk would; over gRPC tritonclient's asyncio client
    sends the prepared inputs. With ``shared_memory`` (``"system"`` or ``"cuda"``, one
    payload only) the inputs are written once into a registered shared-memory region and the outputs are
    asked for in it too, as perf_analyzer's ``--shared-memory`` does (same host only;
    ``access_token`` for servers that restrict that API, as PyTriton does).
    """

    remote = True

    def __init__(
        self,
        url: str,
        model: str,
        inputs: Payloads,
        *,
        shared_memory: str | None = None,
        access_token: str | None = None,
        binary: bool = True,
        sequence_length: int = 0,
    ) -> None:
        from ..client import AsyncClient, Client

        self.name = f"{url} {model}{f' ({shared_memory} shm)' if shared_memory else ''}"
        self._sequences = Sequences(sequence_length)
        payloads = _payloads(inputs)
        if shared_memory and len(payloads) > 1:
            raise ServekitError(
                f"shared memory holds one payload, got {len(payloads)}: give one entry"
            )
        self.url, self.model, self.inputs = url, model, payloads[0]
        self._registrar = None
        self._session: Any = None
        self._outputs: list[Any] | None = None
        if shared_memory:
            self._registrar = Client(url, shared_memory=shared_memory, access_token=access_token)
            try:
                if sequence_length or any(a.dtype == object for a in self.inputs.values()):
                    self._prepared = self._registrar.prepare(self.inputs)  # outputs: the socket
                else:  # a first answer, over the socket, sizes the outputs' places
                    like = self._registrar.infer(model, self.inputs)
                    self._prepared, self._outputs = self._registrar.prepare_in_region(
                        self.inputs, like
                    )
            except BaseException:
                self._registrar.close()
                raise
            self._client = AsyncClient(url)
        else:
            self._client = AsyncClient(url)
            self._prepared = self._client.prepare(self.inputs, binary=binary)
        self._requests = [self._prepared] + [
            self._client.prepare(p, binary=binary) for p in payloads[1:]
        ]
        self._turn = itertools.cycle(range(len(self._requests)))
        self._bodies: dict[int | None, list[tuple[bytes, dict[str, str]]]] = {}
        if url.startswith("http://"):
            self._bodies[None] = self._encode(None)
            self._endpoint = f"{url}/v2/models/{model}/infer"

    def _encode(self, timeout_us: int | None) -> list[tuple[bytes, dict[str, str]]]:
        """Each request's HTTP body and headers, ``timeout_us`` in its parameters."""
        import tritonclient.http as th

        bodies = []
        for prepared in self._requests:
            body, json_size = th.InferenceServerClient.generate_request_body(
                prepared, outputs=self._outputs, timeout=timeout_us
            )
            headers = {
                "Content-Type": "application/octet-stream" if json_size else "application/json"
            }
            if json_size is not None:
                headers["Inference-Header-Content-Length"] = str(json_size)
            bodies.append((body, headers))
        return bodies

    async def check(self) -> None:
        """Fail fast and clearly: the server must answer and know the model."""
        try:
            await self.send()  # the very request the measurement sends
        except ServerUnreachable as exc:
            raise ServerUnreachable(f"{exc} (is the server up at {self.url}?)") from None

    async def send(self, timeout_us: int | None = None) -> None:
        flags = self._sequences.next()
        turn = next(self._turn)
        if not self._bodies:
            # A call given up is cancelled: grpc.aio resets its stream (RST_STREAM).
            await self._client.infer_prepared(
                self.model, self._requests[turn], outputs=self._outputs, timeout_us=timeout_us,
                **flags,
            )  # fmt: skip
            return
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if timeout_us not in self._bodies:
            self._bodies[timeout_us] = self._encode(timeout_us)
        whole, headers = self._bodies[timeout_us][turn]
        if flags:  # the sequence's parameters are in the request's JSON: made per request
            import tritonclient.http as th

            whole, json_size = th.InferenceServerClient.generate_request_body(
                self._requests[turn], outputs=self._outputs, timeout=timeout_us, **flags
            )
            if json_size is not None:
                headers = {**headers, "Inference-Header-Content-Length": str(json_size)}
        try:
            # aiohttp streams a body over 1 MB from a file object (and warns on raw bytes).
            body = whole if len(whole) <= 1 << 20 else io.BytesIO(whole)
            # Cancelled before the whole answer is read (the client gave up), aiohttp
            # closes the connection instead of returning it to the pool.
            async with self._session.post(self._endpoint, data=body, headers=headers) as r:
                payload = await r.read()
                if r.status != 200:
                    text = payload[:500].decode("utf-8", "replace")
                    raise _http_error(r.status, text, r.headers.get("Retry-After"))
        except aiohttp.ClientError as exc:
            raise ServerUnreachable(f"cannot reach {self.url}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._client.close()
        if self._registrar is not None:
            self._registrar.close()


def _http_error(status: int, message: str, retry_after: str | None) -> ServekitError:
    """The error an HTTP answer other than 200 stands for; a 503's ``Retry-After`` (in
    seconds) is kept as an ``Overloaded``'s hint, and a 503 without one asks no wait."""
    from ..errors import Overloaded, from_http_status

    error = from_http_status(status, message)
    if status != 503:
        return error
    try:
        seconds = float(retry_after) if retry_after is not None else 0.0
    except ValueError:  # an HTTP date: not what a server under load sends
        seconds = 0.0
    if seconds > 0 or isinstance(error, Overloaded):
        return Overloaded(message, retry_after_s=max(seconds, 0.0))
    return error


class StreamTarget:
    """Each worker's requests over one gRPC stream of its own (``ModelStreamInfer``), as
    perf_analyzer's ``--streaming``: the closed loop keeps one request in flight per
    stream, so each answer (or error) is that worker's."""

    remote = True

    def __init__(self, url: str, model: str, inputs: Payloads, sequence_length: int = 0) -> None:
        import tritonclient.grpc as tg
        import tritonclient.grpc.aio as aio

        from ..protocol.kserve import tensor_to_raw

        if not url.startswith("grpc://"):
            raise ServekitError(f"streaming needs a grpc:// url, got {url!r}")
        self.name, self.url, self.model = f"{url} {model} (stream)", url, model
        self._client = aio.InferenceServerClient(url.removeprefix("grpc://"))
        self._requests: list[list[Any]] = []
        for payload in _payloads(inputs):
            tensors = []
            for name, array in payload.items():
                datatype, _ = tensor_to_raw(array)
                tensor = tg.InferInput(name, list(array.shape), datatype)
                tensor.set_data_from_numpy(array)
                tensors.append(tensor)
            self._requests.append(tensors)
        self._turn = itertools.cycle(self._requests)
        self._sequences = Sequences(sequence_length)
        self._streams: dict[object, tuple[asyncio.Queue[Any], list[asyncio.Future[None]]]] = {}
        self._readers: list[asyncio.Task[None]] = []

    async def check(self) -> None:
        await self.send()

    def _open(self, worker: object) -> tuple[asyncio.Queue[Any], list[asyncio.Future[None]]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        waiting: list[asyncio.Future[None]] = []

        async def requests() -> Any:
            while (request := await queue.get()) is not None:
                yield request

        async def read() -> None:
            ended = "the server ended the stream"
            try:
                async for _, error in self._client.stream_infer(requests()):
                    future = waiting.pop(0)
                    if error is not None:
                        future.set_exception(ServekitError(str(error)))
                    else:
                        future.set_result(None)
            except Exception as exc:
                ended = f"{type(exc).__name__}: {exc}"
            # The stream is gone (a server that died ends it): what waits fails, and the
            # worker's next request opens a new one.
            if self._streams.get(worker, (None,))[0] is queue:
                del self._streams[worker]
            for future in waiting:
                if not future.done():
                    future.set_exception(ServerUnreachable(f"{self.url}: {ended}"))

        self._readers.append(asyncio.create_task(read()))
        self._streams[worker] = (queue, waiting)
        return queue, waiting

    async def send(self, timeout_us: int | None = None) -> None:
        if timeout_us is not None:
            raise ServekitError(
                "a stream's requests cannot be given up one by one: a client timeout needs "
                "unary calls (no --streaming)"
            )
        worker = asyncio.current_task()
        queue, waiting = self._streams.get(worker) or self._open(worker)
        future = asyncio.get_running_loop().create_future()
        waiting.append(future)
        inputs = next(self._turn)
        request = {"model_name": self.model, "inputs": inputs, **self._sequences.next()}
        queue.put_nowait(request)
        await future

    async def close(self) -> None:
        for queue, _ in self._streams.values():
            queue.put_nowait(None)  # each stream's requests end: the server ends it
        if self._readers:
            await asyncio.wait(self._readers, timeout=5)
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await self._client.close()


class BatcherTarget:
    """An in-process ``Batcher`` (servekit's own dynamic batching, no network)."""

    def __init__(
        self, batcher: Any, inputs: Mapping[str, np.ndarray], name: str = "batcher"
    ) -> None:
        self.name, self.batcher, self.inputs = name, batcher, dict(inputs)

    async def check(self) -> None:
        await self.send()

    async def send(self, timeout_us: int | None = None) -> None:
        await self.batcher.infer(self.inputs, timeout_us=timeout_us)

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

    async def send(self, timeout_us: int | None = None) -> None:
        """``timeout_us`` is not the runner's to honour: a call given up still runs."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self.runner.infer, self.inputs)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)


def open_target(
    url: str,
    model: str,
    inputs: Payloads,
    *,
    shared_memory: str | None = None,
    access_token: str | None = None,
    binary: bool = True,
    streaming: bool = False,
    sequence_length: int = 0,
) -> RemoteTarget | StreamTarget:
    """A remote target for ``http://host:port`` or ``grpc://host:port``, sending ``inputs``
    (one payload, or several in turn); ``binary=False``
    sends JSON (HTTP only), as wrk or curl would; ``streaming``: each worker's requests over
    a gRPC stream of its own; ``sequence_length``: each worker runs sequences of so many
    requests (unique ids, START on the first, END on the last)."""
    if not url.startswith(("http://", "grpc://")):
        raise ServekitError(f"target url must start with http:// or grpc://, got {url!r}")
    if streaming:
        if shared_memory:
            raise ServekitError("--streaming sends its tensors in the stream: no shared memory")
        return StreamTarget(url, model, inputs, sequence_length)
    return RemoteTarget(
        url, model, inputs, shared_memory=shared_memory, access_token=access_token,
        binary=binary, sequence_length=sequence_length,
    )  # fmt: skip
