"""Client helper over tritonclient: any KServe v2 server (Triton, PyTriton, servekit's fronts).

``Client("http://127.0.0.1:8000")`` or ``Client("grpc://127.0.0.1:8001")`` sends numpy
dicts and returns numpy dicts; ``AsyncClient`` does the same with ``await``. Remote
errors come back as servekit's own exceptions (``InvalidInput`` for a 400 or
INVALID_ARGUMENT, ``ModelNotFound``, ``ModelNotReady``...). With
``shared_memory="system"`` (or True; same host only) inputs travel through a system
shared-memory region instead of the socket, and with ``"cuda"`` through a buffer on GPU 0
(``tritonclient.utils.cuda_shared_memory``, which needs cuda-python and a GPU here);
``prepare_in_region`` places the outputs there too.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import numpy as np

from .errors import (
    CONTROL_TOKEN_HEADER,
    GRPC_HEADER_PREFIX,
    INFERENCE_TOKEN_HEADER,
    PYTRITON_TOKEN_HEADER,
    ModelNotReady,
    ServekitError,
    ServerUnreachable,
    SetupError,
    from_grpc_code,
    from_http_status,
)
from .pipeline import Prediction
from .spec import as_dtype

__all__ = ["AsyncClient", "Client"]


def _parse(url: str) -> tuple[str, str]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "grpc"):
        raise ValueError(f"url must start with http:// or grpc://, got {url!r}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"url needs a host and a port, got {url!r}")
    return parsed.scheme, f"{parsed.hostname}:{parsed.port}"


def _error(exc: Exception, protocol: str) -> ServekitError:
    status = getattr(exc, "status", lambda: None)()
    message = getattr(exc, "message", lambda: str(exc))() or str(exc)
    if protocol == "grpc":
        if "failed to connect to all addresses" in message:  # gRPC's own, not the server's
            return ServerUnreachable(f"cannot reach the server: {message}")
        return from_grpc_code(str(status or "UNKNOWN"), message)
    try:
        code = int(status) if status is not None else 0
    except ValueError:
        code = 0
    if code == 0:  # no HTTP status: the connection itself failed
        return ServerUnreachable(f"cannot reach the server: {message}")
    return from_http_status(code, message)


def _remote_failure(exc: Exception, url: str, protocol: str) -> ServekitError:
    """A tritonclient failure as a servekit error: no status means the server was unreachable."""
    if isinstance(exc, ServekitError):
        return exc
    if not hasattr(exc, "status"):
        return ServerUnreachable(f"cannot reach {url}: {exc}")
    return _error(exc, protocol)


def _blobs(images: Sequence[bytes]) -> np.ndarray:
    arr = np.empty((len(images), 1), dtype=object)
    arr[:, 0] = list(images)
    return arr


def _predictions(out: Mapping[str, np.ndarray]) -> list[list[Prediction]]:
    return [
        [Prediction(lab.decode(), int(c), float(s)) for s, c, lab in zip(*row, strict=True)]
        for row in zip(out["scores"], out["classes"], out["labels"], strict=True)
    ]


GRPC_PREFIX = GRPC_HEADER_PREFIX
TOKEN_HEADERS = {
    "http": (PYTRITON_TOKEN_HEADER, CONTROL_TOKEN_HEADER),
    "grpc": (GRPC_PREFIX + PYTRITON_TOKEN_HEADER, GRPC_PREFIX + CONTROL_TOKEN_HEADER),
}
"""Headers carrying the token for Triton's restricted APIs, per protocol: PyTriton's and
servekit's (the triton and native runtimes), so one ``access_token`` works on each."""


class _Base:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        shared_memory: bool | str = False,
        access_token: str | None = None,
        inference_token: str | None = None,
    ) -> None:
        self.url = url
        self.protocol, self.address = _parse(url)
        self._headers = (
            dict.fromkeys(TOKEN_HEADERS[self.protocol], access_token) if access_token else None
        )
        # Triton reads a restricted gRPC protocol's header under this prefix.
        key = (
            INFERENCE_TOKEN_HEADER
            if self.protocol == "http"
            else GRPC_PREFIX + INFERENCE_TOKEN_HEADER
        )
        self._infer_headers = {key: inference_token} if inference_token else None
        self.timeout_s = timeout_s
        self.shared_memory = _shm_kind(shared_memory)
        """None, ``"system"`` or ``"cuda"``: where inputs travel instead of the socket."""
        self._mod: Any = None
        self._shm: tuple[str, Any, int] | None = None  # (name, handle, size)
        self._placed: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}

    def _module(self) -> Any:
        if self._mod is None:
            try:
                if self.protocol == "http":
                    import tritonclient.http as mod
                else:
                    import tritonclient.grpc as mod
            except ImportError:
                raise ImportError(
                    "servekit.client needs tritonclient: pip install 'servekit[triton]'"
                ) from None
            self._mod = mod
        return self._mod

    def _inputs(
        self, client: Any, inputs: Mapping[str, np.ndarray], binary: bool, room: int = 0
    ) -> list[Any]:
        mod = self._module()
        out = []
        arrays = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
        use_shm = self.shared_memory and all(a.dtype.kind != "O" for a in arrays.values())
        if use_shm:
            self._ensure_region(client, sum(a.nbytes for a in arrays.values()) + room)
            name, handle, _ = self._shm  # type: ignore[misc]
            offset = 0
            if self.shared_memory == "cuda":  # written in one go, one after the other
                _cuda_shm().set_shared_memory_region(handle, list(arrays.values()))
            for k, a in arrays.items():
                if self.shared_memory == "system":
                    _system_shm().set_shared_memory_region(handle, [a], offset=offset)
                i = mod.InferInput(k, list(a.shape), as_dtype(a.dtype).datatype)
                i.set_shared_memory(name, a.nbytes, offset=offset)
                out.append(i)
                offset += a.nbytes
            return out
        return out + self._socket_inputs(arrays, binary)

    def _socket_inputs(self, inputs: Mapping[str, np.ndarray], binary: bool) -> list[Any]:
        """Inputs that travel in the request itself (binary tensors or JSON over HTTP)."""
        mod = self._module()
        out = []
        for k, a in inputs.items():
            a = np.ascontiguousarray(a)
            i = mod.InferInput(k, list(a.shape), as_dtype(a.dtype).datatype)
            if self.protocol == "http":
                i.set_data_from_numpy(a, binary_data=binary)
            else:
                i.set_data_from_numpy(a)
            out.append(i)
        return out

    def _output_names(self, result: Any) -> list[str]:
        """The outputs whose values came in the response; one written into a shared-memory
        region comes with its shape alone (tritonserver does not name the region)."""
        response = result.get_response()
        if self.protocol == "http":
            return [
                o["name"] for o in response["outputs"]
                if "data" in o or "binary_data_size" in o.get("parameters", {})
            ]  # fmt: skip
        raw = response.raw_output_contents
        return [
            o.name for i, o in enumerate(response.outputs)
            if (i < len(raw) and (raw[i] or not math.prod(o.shape))) or o.HasField("contents")
        ]  # fmt: skip

    def _ensure_region(self, client: Any, size: int) -> None:
        if self._shm is not None and self._shm[2] >= size:
            return
        self._release_region(client)
        name = f"servekit-{uuid.uuid4().hex[:12]}"
        cuda = self.shared_memory == "cuda"
        try:
            shm = _cuda_shm() if cuda else _system_shm()
            if cuda:
                handle = shm.create_shared_memory_region(name, size, 0)
            else:
                handle = shm.create_shared_memory_region(name, f"/{name}", size)
        except Exception as exc:  # this host's doing, not the server's
            raise SetupError(
                f"cannot make a {self.shared_memory} shared-memory region of {size} bytes "
                f"here{' (on GPU 0)' if cuda else ''}: {type(exc).__name__}: {exc}"
            ) from None
        try:
            if cuda:
                raw = shm.get_raw_handle(handle)
                client.register_cuda_shared_memory(name, raw, 0, size, headers=self._headers)
            else:
                client.register_system_shared_memory(name, f"/{name}", size, headers=self._headers)
        except Exception as exc:
            shm.destroy_shared_memory_region(handle)
            raise _error(exc, self.protocol) from None
        self._shm = (name, handle, size)

    def _release_region(self, client: Any) -> None:
        if self._shm is None:
            return
        cuda = self.shared_memory == "cuda"
        shm = _cuda_shm() if cuda else _system_shm()
        unregister = (
            client.unregister_cuda_shared_memory if cuda else client.unregister_system_shared_memory
        )
        name, handle, _ = self._shm
        self._shm = None
        try:
            # Triton lets go of a region a moment after it answers the request that used
            # it; until then it refuses to unregister it ("currently in use").
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    unregister(name, headers=self._headers)
                    break
                except Exception as exc:
                    if "in use" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            shm.destroy_shared_memory_region(handle)


def _shm_kind(value: bool | str | None) -> str | None:
    """``shared_memory`` as None, ``"system"`` or ``"cuda"`` (True: system)."""
    if value in (None, False, "none"):
        return None
    if value is True:
        return "system"
    if value not in ("system", "cuda"):
        raise ValueError(f"shared_memory: none, system or cuda, got {value!r}")
    return str(value)


def _system_shm() -> Any:
    import tritonclient.utils.shared_memory as shm

    return shm


def _cuda_shm() -> Any:
    import tritonclient.utils.cuda_shared_memory as cuda_shm

    return cuda_shm


class Client(_Base):
    """Blocking client; one per thread (tritonclient's clients are not shared safely).

    ``access_token`` is sent on Triton's restricted management APIs (shared-memory
    registration on PyTriton servers: ``TritonServer.access_token``); ``inference_token``
    on every inference (``servekit triton --inference-token``, ``KServeApp``).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        shared_memory: bool | str = False,
        access_token: str | None = None,
        inference_token: str | None = None,
    ) -> None:
        super().__init__(
            url,
            timeout_s=timeout_s,
            shared_memory=shared_memory,
            access_token=access_token,
            inference_token=inference_token,
        )
        mod = self._module()
        if self.protocol == "http":
            self._client = mod.InferenceServerClient(
                self.address, connection_timeout=timeout_s, network_timeout=timeout_s
            )
        else:
            self._client = mod.InferenceServerClient(self.address)

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Sequence[str] | None = None,
        binary: bool = True,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        """Run ``model`` on ``inputs`` (batch dim first); ``binary=False`` sends JSON (HTTP)."""
        try:
            result = self._client.infer(
                model,
                self._inputs(self._client, inputs, binary),
                model_version=version,
                headers=self._infer_headers,
                **({"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}),
            )
        except Exception as exc:
            raise _remote_failure(exc, self.url, self.protocol) from None
        names = outputs or self._output_names(result)
        return {n: result.as_numpy(n) for n in names}

    def classify(
        self, images: Sequence[bytes], model: str = "resnet50_image"
    ) -> list[list[Prediction]]:
        """Top-k predictions for encoded images from an image model."""
        return _predictions(self.infer(model, {"image": _blobs(images)}))

    def prepare(self, inputs: Mapping[str, np.ndarray], *, binary: bool = True) -> list[Any]:
        """tritonclient inputs built once (written to shared memory when enabled); reusable
        with ``infer_prepared`` here or on an ``AsyncClient`` of the same protocol, as long
        as the inputs do not change."""
        try:
            return self._inputs(self._client, inputs, binary)
        except Exception as exc:
            raise _remote_failure(exc, self.url, self.protocol) from None

    def prepare_in_region(
        self, inputs: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]
    ) -> tuple[list[Any], list[Any]]:
        """Inputs and outputs both through this client's shared-memory region, as
        perf_analyzer's ``--shared-memory`` sends them: the inputs written there (``prepare``),
        and for each output of ``like`` (an answer to the same inputs) a place after them as
        large as it is there, for ``infer_prepared(..., outputs=...)``; the server writes
        them there and ``outputs_in_region`` reads them back. BYTES outputs, whose size
        varies, are asked for over the socket."""
        if not self.shared_memory:
            raise ValueError("prepare_in_region needs a client made with shared_memory")
        if any(np.asarray(a).dtype == object for a in inputs.values()):
            raise ValueError("prepare_in_region: BYTES inputs travel over the socket")
        mod = self._module()
        placed = {k: np.asarray(a) for k, a in like.items() if np.asarray(a).dtype != object}
        prepared = self._inputs(self._client, inputs, True, sum(a.nbytes for a in placed.values()))
        assert self._shm is not None  # _inputs made the region
        name, offset = self._shm[0], sum(np.asarray(a).nbytes for a in inputs.values())
        requested, self._placed = [], {}
        for k in like:
            out = mod.InferRequestedOutput(k)
            if k in placed:
                out.set_shared_memory(name, placed[k].nbytes, offset=offset)
                self._placed[k] = (offset, placed[k].dtype, placed[k].shape)
                offset += placed[k].nbytes
            requested.append(out)
        return prepared, requested

    def outputs_in_region(self) -> dict[str, np.ndarray]:
        """The outputs the last request made with ``prepare_in_region``'s outputs left in
        the region (copies)."""
        if self._shm is None or not self._placed:
            raise ValueError("outputs_in_region: no outputs placed (call prepare_in_region)")
        shm, handle = _cuda_shm() if self.shared_memory == "cuda" else _system_shm(), self._shm[1]
        return {
            k: np.array(shm.get_contents_as_numpy(handle, dtype, shape, offset=offset))
            for k, (offset, dtype, shape) in self._placed.items()
        }

    def metadata(self, model: str) -> dict[str, Any]:
        """The model's KServe v2 metadata: ``inputs``/``outputs`` with name, datatype, shape."""
        try:
            if self.protocol == "http":
                return dict(self._client.get_model_metadata(model))
            return dict(self._client.get_model_metadata(model, as_json=True))
        except Exception as exc:
            raise _remote_failure(exc, self.url, self.protocol) from None

    def is_ready(self, model: str | None = None) -> bool:
        try:
            if model is None:
                return bool(self._client.is_server_ready())
            return bool(self._client.is_model_ready(model))
        except Exception:
            return False

    def wait_ready(self, model: str | None = None, timeout_s: float = 60.0) -> None:
        """Wait until the server (or ``model``) is ready; raise ``ModelNotReady`` on timeout."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready(model):
            if time.monotonic() > deadline:
                raise ModelNotReady(
                    f"{model or 'server'} at {self.url} not ready after {timeout_s} s"
                )
            time.sleep(0.2)

    def close(self) -> None:
        try:
            self._release_region(self._client)
        finally:
            self._client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """``await``-able client over tritonclient's aio clients (no shared memory)."""

    def __init__(
        self, url: str, *, timeout_s: float = 60.0, inference_token: str | None = None
    ) -> None:
        super().__init__(url, timeout_s=timeout_s, inference_token=inference_token)
        if self.protocol == "http":
            import tritonclient.http.aio as aio
        else:
            import tritonclient.grpc.aio as aio
        self._aio = aio
        self._client = aio.InferenceServerClient(self.address)

    def prepare(self, inputs: Mapping[str, np.ndarray], *, binary: bool = True) -> list[Any]:
        """tritonclient inputs built once, for many ``infer_prepared`` calls."""
        return self._socket_inputs(inputs, binary)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        binary: bool = True,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        """Run ``model`` (``version``: a version number, "" = as the version policy picks);
        ``priority`` and ``timeout_us`` are Triton's request parameters."""
        prepared = self.prepare(inputs, binary=binary)
        return await self.infer_prepared(
            model, prepared, priority=priority, timeout_us=timeout_us, version=version
        )

    async def infer_prepared(
        self,
        model: str,
        prepared: list[Any],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
        sequence_id: int | str = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
        outputs: list[Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``model`` on inputs from ``prepare`` (this client's or a ``Client``'s);
        ``sequence_*``: the request's place in a sequence (a sequence-batched model);
        ``outputs``: those ``Client.prepare_in_region`` placed (the answer then holds only
        the outputs that came over the socket)."""
        scheduling: dict[str, Any] = {"priority": priority} if priority else {}
        if timeout_us is not None:
            scheduling["timeout"] = timeout_us
        if sequence_id:
            scheduling.update(
                sequence_id=sequence_id, sequence_start=sequence_start, sequence_end=sequence_end
            )
        try:
            result = await self._client.infer(
                model, prepared, model_version=version, headers=self._infer_headers,
                outputs=outputs, **scheduling,
            )  # fmt: skip
        except Exception as exc:
            raise _remote_failure(exc, self.url, self.protocol) from None
        return {n: result.as_numpy(n) for n in self._output_names(result)}

    async def classify(
        self, images: Sequence[bytes], model: str = "resnet50_image"
    ) -> list[list[Prediction]]:
        return _predictions(await self.infer(model, {"image": _blobs(images)}))

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
