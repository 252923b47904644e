"""Triton's CUDA shared memory, the device's side: a client on the same host allocates a
buffer on a GPU (``cudaMalloc``), exports it (``cudaIpcGetMemHandle``: 64 opaque bytes)
and registers the handle, the device id and the size; the server maps the buffer
(``cudaIpcOpenMemHandle``) and reads inputs from it and writes outputs into it.
``tritonclient.utils.cuda_shared_memory`` is such a client.

``open_ipc`` opens one handle through cuda-python's runtime bindings (the ``torch`` extra
installs them); ``cuda_devices`` says how many devices this process sees and, where it
sees none, why. The registry of regions (names, leases, offsets) is ``shm.SharedMemory``'s;
this module moves bytes, and ``OnDevice`` is the registry as a model on a GPU reads it:
inputs stay on the device, and a request whose outputs all go into CUDA regions there is
answered there (``keep_outputs``), its outputs copied device to device.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..cuda import layer
from ..device import DeviceTensor
from ..errors import InvalidInput

if TYPE_CHECKING:
    from .shm import SharedMemory, ShmRef

__all__ = [
    "HANDLE_SIZE", "CudaMemory", "OnDevice", "Opener", "cuda_devices", "keep_outputs", "open_ipc",
]  # fmt: skip

log = logging.getLogger("servekit")

HANDLE_SIZE = 64
"""Bytes of a ``cudaIpcMemHandle_t``."""


class CudaMemory(Protocol):
    """One registered buffer on a device, as the registry uses it."""

    device_id: int
    byte_size: int

    def to_host(self, start: int, size: int) -> np.ndarray:
        """``size`` bytes from ``start``, copied into host memory (uint8)."""
        ...

    def to_device(self, start: int, size: int) -> Any:
        """``size`` bytes from ``start``, copied device to device into a new torch uint8
        tensor on the buffer's device (the client may reuse the buffer once answered)."""
        ...

    def from_host(self, start: int, data: bytes) -> None:
        """Write ``data`` at ``start``, finished when this returns."""
        ...

    def from_tensor(self, start: int, tensor: Any) -> bool:
        """Write a torch tensor's bytes at ``start``, finished when this returns: device to
        device where the tensor lies on the buffer's device (True), from the host otherwise."""
        ...

    def close(self) -> None: ...


class Opener(Protocol):
    """How a registration becomes memory: ``open_ipc`` on a real device."""

    def __call__(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int
    ) -> CudaMemory: ...


def _runtime() -> Any:
    """cuda-python's runtime bindings, or None where they are not installed."""
    try:
        import cuda.bindings.runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6
        except ImportError:
            return None
    return cudart


def _checked(result: tuple[Any, ...], what: str) -> Any:
    """The value of a cuda-python call, or ``InvalidInput`` with CUDA's error name."""
    err, *value = result
    if int(err) != 0:
        raise InvalidInput(f"{what}: {_error_name(err)}")
    if not value:
        return None
    return value[0] if len(value) == 1 else tuple(value)


def _error_name(err: Any) -> str:
    """CUDA's name and words for a runtime or driver error code."""
    name = getattr(err, "name", str(err))
    if name.startswith("cuda"):
        cudart = _runtime()
        return f"{name}: {cudart.cudaGetErrorString(err)[1].decode()}"
    return name


@functools.cache
def cuda_devices() -> tuple[int, str]:
    """(how many CUDA devices this process sees, why none where it sees none)."""
    cudart = _runtime()
    if cudart is None:
        return 0, "cuda-python is not installed (pip install 'servekit[torch]')"
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0:
        return 0, f"no CUDA device here ({_error_name(err)})"
    return (count, "") if count else (0, "no CUDA device here")


class _IpcMemory:
    """A buffer another process exported, mapped into this one."""

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        cudart = self._cudart = layer().runtime()
        self.device_id, self.byte_size = device_id, byte_size
        handle = cudart.cudaIpcMemHandle_t()
        # cuda-bindings 13 exposes the handle's bytes only through its address.
        ctypes.memmove(handle.getPtr(), raw_handle, HANDLE_SIZE)
        self._on_device()
        self.ptr = int(
            _checked(
                cudart.cudaIpcOpenMemHandle(handle, cudart.cudaIpcMemLazyEnablePeerAccess),
                f"CUDA shared-memory region {name!r}: its handle does not open on device "
                f"{device_id}",
            )
        )
        try:
            self._check_size(name)
        except BaseException:
            self.close()
            raise

    def _check_size(self, name: str) -> None:
        """The allocation behind the handle holds ``byte_size`` bytes: a read past it would
        be an illegal address, which ends every later CUDA call of the process."""
        try:
            base, size = _checked(layer().driver().cuMemGetAddressRange(self.ptr), "")
        except InvalidInput as exc:  # not known: the client's byte_size is taken as given
            log.warning(
                "CUDA shared-memory region %r: its allocation's size is unknown%s", name, exc
            )
            return
        room = int(size) - (self.ptr - int(base))
        if self.byte_size > room:
            raise InvalidInput(
                f"CUDA shared-memory region {name!r}: byte_size {self.byte_size} exceeds the "
                f"{room} bytes allocated behind its handle"
            )

    def _on_device(self) -> None:
        _checked(self._cudart.cudaSetDevice(self.device_id), f"device {self.device_id}")

    def _copy(self, dst: int, src: int, size: int, kind: str, doing: str) -> None:
        """``size`` bytes copied on this thread's own non-blocking stream (never the
        legacy default one), finished when this returns."""
        cudart = self._cudart
        self._on_device()
        stream = _side_stream(cudart, self.device_id)
        _checked(
            cudart.cudaMemcpyAsync(dst, src, size, getattr(cudart.cudaMemcpyKind, kind), stream),
            doing,
        )
        _checked(cudart.cudaStreamSynchronize(stream), doing)

    def to_host(self, start: int, size: int) -> np.ndarray:
        out = np.empty(size, np.uint8)
        kind = "cudaMemcpyDeviceToHost"
        self._copy(out.ctypes.data, self.ptr + start, size, kind, "reading CUDA shared memory")
        return out

    def to_device(self, start: int, size: int) -> Any:
        gpu = layer()
        device = gpu.device(self.device_id)
        stream = gpu.side_stream(device)
        with gpu.using(stream):
            span = gpu.tensor_at(self.ptr + start, size, device)
            out = span.clone()  # device to device, on this thread's own stream
        gpu.synchronize(stream)  # before an unregister may unmap
        return out

    def from_host(self, start: int, data: bytes) -> None:
        src = np.frombuffer(data, np.uint8)
        kind = "cudaMemcpyHostToDevice"
        self._copy(self.ptr + start, src.ctypes.data, len(src), kind, "writing CUDA shared memory")

    def from_tensor(self, start: int, tensor: Any) -> bool:
        import torch

        gpu = layer()
        device = gpu.device(self.device_id)
        if tensor.device != device:
            self.from_host(start, tensor.cpu().numpy().tobytes())
            return False
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            stream = gpu.side_stream(device)
            with gpu.using(stream):
                span = gpu.tensor_at(self.ptr + start, data.numel(), device)
                span.copy_(data)  # device to device, on this thread's own stream
            gpu.synchronize(stream)  # read once answered
        return True

    def close(self) -> None:
        self._on_device()
        self._cudart.cudaIpcCloseMemHandle(self.ptr)


_STREAMS = threading.local()


def _side_stream(cudart: Any, device_id: int) -> Any:
    """This thread's own non-blocking stream on ``device_id`` for copies made with CUDA's
    runtime (a copy on the legacy default stream would wait on every blocking stream)."""
    streams = _STREAMS.__dict__.setdefault("streams", {})
    if device_id not in streams:
        flags = cudart.cudaStreamNonBlocking
        streams[device_id] = _checked(
            cudart.cudaStreamCreateWithFlags(flags), f"a stream on device {device_id}"
        )
    return streams[device_id]


def open_ipc(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaMemory:
    """Map the buffer ``raw_handle`` exports, on ``device_id``; ``InvalidInput`` naming the
    region where the handle does not open there."""
    return _IpcMemory(name, raw_handle, device_id, byte_size)


class OnDevice:
    """``SharedMemory`` as a model that takes tensors on CUDA ``device`` reads it (``for_device``):
    inputs in CUDA regions on that device stay there as ``DeviceTensor``s."""

    def __init__(self, regions: SharedMemory, device: Any) -> None:
        self._regions, self._device = regions, device

    def tensor(self, ref: ShmRef, name: str, datatype: str, shape: list[int]) -> Any:
        return self._regions.tensor(ref, name, datatype, shape, self._device)

    def write(self, ref: ShmRef, name: str, raw: bytes | DeviceTensor) -> None:
        self._regions.write(ref, name, raw)

    def keep_outputs(
        self, inputs: Mapping[str, Any], wanted: Sequence[str], refs: Mapping[str, ShmRef]
    ) -> None:
        """Mark a request's device inputs to have it answered on the device, where every
        output it asks for (``wanted``) goes into a CUDA region (``refs``) on it."""
        index = self._device.index or 0
        if wanted and all(
            n in refs and self._regions.cuda_device(refs[n].region) == index for n in wanted
        ):
            for value in inputs.values():
                if isinstance(value, DeviceTensor):
                    value.keep_outputs = True


def keep_outputs(
    regions: object, inputs: Mapping[str, Any], wanted: Sequence[str], refs: Mapping[str, ShmRef]
) -> None:
    """``OnDevice.keep_outputs`` where ``regions`` is that view; nothing otherwise."""
    if isinstance(regions, OnDevice):
        regions.keep_outputs(inputs, wanted, refs)
