"""Triton's system shared-memory extension: a client on the same host registers a region
(a POSIX shared-memory key, an offset and a size) and then names it in an infer request's
inputs and outputs instead of sending their bytes (seed 002: 15 % on large images).

``SharedMemory`` holds the registered regions of one server (HTTP and gRPC share it);
``shm_ref`` reads a tensor's ``shared_memory_region``/``_offset``/``_byte_size``
parameters. Every access is checked as Triton checks it: the region is registered, the
tensor's bytes lie inside it, and its size is the tensor's. The hardening Triton added
after CVE-2025-23319: registration is behind the control token (the caller's job), a key
names a plain file of ``/dev/shm`` (no path, no symbolic link) and never one of the
serving stack's own regions. The front of the Triton runtimes, which hands requests on to
tritonserver, checks tensors against their declared sizes only (``Declared``): the
region is tritonserver's to read.

The same registry holds CUDA shared-memory regions (Triton's other extension: a buffer on
a GPU, registered by its IPC handle; ``cudashm`` moves the bytes). Region names are one
namespace across both kinds, as in Triton. An input read for a model that takes tensors
on that GPU (``for_device``) stays there as a ``DeviceTensor``; any other is copied to
the host. Unregistering a CUDA region waits for the copies in flight on it.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..device import DeviceTensor, torch_dtype
from ..errors import InvalidInput, RegionNotFound, RunnerError
from ..spec import ModelSpec, as_dtype
from .cudashm import HANDLE_SIZE, CudaMemory, OnDevice, Opener, cuda_devices, open_ipc
from .shmkeys import SHM_ROOT, check_registration, open_key

__all__ = [
    "BYTE_SIZE",
    "CUDA_COPIES",
    "RegionNotFound",
    "check_output_room",
    "cuda_refusal",
    "check_registration",
    "no_room",
    "open_key",
    "served",
    "write_output",
    "OFFSET",
    "REGION",
    "NO_CUDA_SHARED_MEMORY",
    "NO_SHARED_MEMORY",
    "DECLARED",
    "Declared",
    "KINDS",
    "Regions",
    "SharedMemory",
    "ShmRef",
    "shm_ref",
]

REGION, OFFSET, BYTE_SIZE = (
    "shared_memory_region",
    "shared_memory_offset",
    "shared_memory_byte_size",
)
CUDA_COPIES = "servekit_cuda_shared_memory_copies_total"
CUDA_COPIES_HELP = (
    "Tensors copied between CUDA shared-memory regions and the models, by tensor (input, "
    "output) and path (device: device to device; host: through host memory)"
)
NO_SHARED_MEMORY = (
    "is not served by this server: system shared memory is served on one host by the "
    "native, pytriton and triton runtimes (Ray's replicas may run on other hosts)"
)
NO_CUDA_SHARED_MEMORY = (
    "it is served on a GPU by the native runtime and by tritonserver (the triton and "
    "pytriton runtimes)"
)


def cuda_refusal(regions: SharedMemory | None) -> str | None:
    """Why CUDA shared memory is refused here (None: it is served), worded alike over HTTP
    and gRPC: a server that maps no regions says where shared memory is served, one
    without a CUDA device says why it sees none."""
    if regions is None:
        return f"CUDA shared memory {NO_SHARED_MEMORY}"
    why = regions.cuda_missing()
    if why is None:
        return None
    return f"CUDA shared memory is not served by this server: {why}; {NO_CUDA_SHARED_MEMORY}"


@dataclass(frozen=True)
class ShmRef:
    """Where one tensor lies: ``byte_size`` bytes at ``offset`` into a registered region."""

    region: str
    offset: int
    byte_size: int


def shm_ref(parameters: Mapping[str, Any], what: str) -> ShmRef | None:
    """The tensor's shared-memory parameters, checked (``what``: "input 'x'"); None when
    it names no region."""
    region = parameters.get(REGION)
    if region is None:
        stray = sorted(k for k in (OFFSET, BYTE_SIZE) if k in parameters)
        if stray:
            raise InvalidInput(f"{what}: {stray} given without {REGION!r}")
        return None
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{what}: {REGION!r} must be a region's name, got {region!r}")
    numbers = []
    for key, default in ((OFFSET, 0), (BYTE_SIZE, None)):
        value = parameters.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(
                f"{what}: {key!r} must be a non-negative integer, got {value!r}"
                + (" (it is required with a region)" if value is None else "")
            )
        numbers.append(value)
    return ShmRef(region, numbers[0], numbers[1])


class Regions(Protocol):
    """Where an infer's shared-memory tensors are read and written."""

    def tensor(self, ref: ShmRef, name: str, datatype: str, shape: list[int]) -> np.ndarray:
        """Input ``name`` from ``ref`` (a copy: the client may write the region again)."""
        ...

    def write(self, ref: ShmRef, name: str, raw: bytes | DeviceTensor) -> None:
        """Output ``name``'s bytes (or its tensor, kept on a device) into ``ref``."""
        ...


def write_output(regions: Regions, ref: ShmRef, name: str, array: Any) -> int:
    """Output ``name`` written into the region ``ref`` names; the bytes it took. One kept
    on a device (``DeviceTensor``) goes from there, device to device into a CUDA region on
    that device."""
    if isinstance(array, DeviceTensor):
        regions.write(ref, name, array)
        return array.nbytes
    from .kserve import tensor_to_raw

    _, raw = tensor_to_raw(array)
    regions.write(ref, name, raw)
    return len(raw)


def served(regions: Regions | None, ref: ShmRef, name: str) -> Regions:
    """Where tensor ``name``'s region lies; ``InvalidInput`` naming the tensor and the
    region where the server takes no shared memory (Ray, or a front reading no region)."""
    if regions is None:
        raise InvalidInput(
            f"tensor {name!r} names shared-memory region {ref.region!r}, but this server "
            "takes no shared memory (the native, pytriton and triton runtimes do)"
        )
    return regions


def no_room(name: str, need: int, ref: ShmRef) -> InvalidInput:
    """The error for an output larger than the region span given for it."""
    return InvalidInput(
        f"output {name!r}: its {need} bytes do not fit the {ref.byte_size} bytes of region "
        f"{ref.region!r} given for it"
    )


def check_output_room(spec: ModelSpec, rows: int, refs: Mapping[str, ShmRef]) -> None:
    """Each output asked for in a region fits the span given for it, where its size is
    known before the run (a fixed shape, not BYTES): the Triton runtimes' front checks
    this, since tritonserver answers it with a 500 after running the model."""
    lead = [rows] if spec.batched else []
    for t in spec.outputs:
        ref = refs.get(t.name)
        if ref is None or t.dtype.datatype == "BYTES" or any(d < 0 for d in t.shape):
            continue
        need = math.prod([*lead, *t.shape]) * t.dtype.numpy.itemsize
        if need > ref.byte_size:
            raise no_room(t.name, need, ref)


def _expected_bytes(ref: ShmRef, name: str, datatype: str, shape: list[int]) -> int:
    """The tensor's element count, once ``ref``'s size is the one its shape needs
    (BYTES: any size, its elements say their lengths)."""
    count = math.prod(shape)
    if datatype != "BYTES":
        need = count * as_dtype(datatype).numpy.itemsize
        if ref.byte_size != need:
            raise InvalidInput(
                f"input {name!r}: shape {shape} of {datatype} needs {need} bytes, "
                f"region {ref.region!r} gives {ref.byte_size} ({BYTE_SIZE})"
            )
    return count


class Declared:
    """The front's view: a tensor in shared memory is checked against its declared size
    and stands as a zero-copy placeholder of its dtype and shape (enough for the
    signature's checks); tritonserver reads the region itself."""

    def tensor(self, ref: ShmRef, name: str, datatype: str, shape: list[int]) -> np.ndarray:
        _expected_bytes(ref, name, datatype, shape)
        if datatype == "BYTES":
            return np.broadcast_to(np.array(b"", dtype=object), shape)
        return np.broadcast_to(np.zeros((), as_dtype(datatype).numpy), shape)

    def write(self, ref: ShmRef, name: str, raw: bytes | DeviceTensor) -> None:
        raise AssertionError("the front never answers an infer itself")


DECLARED = Declared()
"""The one ``Declared`` (it keeps nothing)."""


@dataclass
class _Region:
    key: str
    offset: int
    byte_size: int
    fd: int
    map: mmap.mmap

    def status(self, name: str) -> dict[str, Any]:
        return {"name": name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass
class _CudaRegion:
    memory: CudaMemory
    in_use: int = 0
    """Copies in flight on it (an unregister waits for none)."""

    @property
    def byte_size(self) -> int:
        return self.memory.byte_size

    def status(self, name: str) -> dict[str, Any]:
        return {"name": name, "device_id": self.memory.device_id, "byte_size": self.byte_size}


KINDS = ("system", "cuda")


class SharedMemory:
    """The shared-memory regions registered with one server, system and CUDA.

    Args:
        root: where system shared-memory keys live.
        open_cuda: how a CUDA registration is mapped; None: ``cudashm.open_ipc`` on the
            devices this process sees (none: CUDA registrations are refused by name).
    """

    def __init__(self, root: str = SHM_ROOT, open_cuda: Opener | None = None) -> None:
        self._root = root
        self._open_cuda = open_cuda
        self._regions: dict[str, _Region] = {}
        self._cuda: dict[str, _CudaRegion] = {}
        self._copies: dict[tuple[str, str], int] = {}  # (input|output, device|host) -> count
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def _check_free(self, name: str) -> None:
        if name in self._regions or name in self._cuda:
            raise InvalidInput(
                f"shared-memory region {name!r} is already registered; unregister it first"
            )

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shared-memory object ``key`` as
        region ``name``; refused (``InvalidInput``) naming what is wrong."""
        fd = open_key(name, key, offset, byte_size, self._root)
        try:
            with self._lock:
                self._check_free(name)
                self._regions[name] = _Region(key, offset, byte_size, fd, mmap.mmap(fd, 0))
        except BaseException:
            os.close(fd)
            raise

    def cuda_missing(self) -> str | None:
        """Why no CUDA region can be registered here (no device, no cuda-python); None
        when they can."""
        if self._open_cuda is not None:
            return None
        count, why = cuda_devices()
        return None if count else why

    def register_cuda(self, name: str, raw_handle: Any, device_id: Any, byte_size: Any) -> None:
        """Map the GPU buffer ``raw_handle`` exports (a ``cudaIpcMemHandle_t``'s bytes) on
        ``device_id`` as region ``name`` of ``byte_size`` bytes; refused
        (``InvalidInput``) naming what is wrong."""
        what = f"CUDA shared-memory region {name!r}"
        if not isinstance(raw_handle, bytes) or len(raw_handle) != HANDLE_SIZE:
            got = f"{len(raw_handle)} bytes" if isinstance(raw_handle, bytes) else repr(raw_handle)
            raise InvalidInput(
                f"{what}: raw_handle must be a cudaIpcMemHandle_t's {HANDLE_SIZE} bytes, got {got}"
            )
        for field, value in (("device_id", device_id), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInput(f"{what}: {field} must be a non-negative integer, got {value!r}")
        if byte_size == 0:
            raise InvalidInput(f"{what}: byte_size must be at least 1, got 0")
        opener = self._open_cuda
        if opener is None:
            count, why = cuda_devices()
            if device_id >= count:
                raise InvalidInput(
                    f"{what}: device_id {device_id}: this server sees {count} CUDA device(s)"
                    + (f" ({why})" if why else "")
                )
            opener = open_ipc
        with self._lock:
            self._check_free(name)
        memory = opener(name, raw_handle, device_id, byte_size)
        with self._lock:
            try:
                self._check_free(name)  # registered meanwhile by another call
            except InvalidInput:
                memory.close()
                raise
            self._cuda[name] = _CudaRegion(memory)

    def unregister(self, name: str | None = None, kind: str = "system") -> None:
        """Forget region ``name`` of ``kind`` (every region of it: None); an unknown name,
        or one of the other kind, is no error, as in Triton. A CUDA region in use is
        forgotten at once and unmapped once its copies in flight are done."""
        with self._lock:
            table: dict[str, Any] = self._cuda if kind == "cuda" else self._regions
            names = list(table) if name is None else [name]
            gone = [table.pop(n) for n in names if n in table]
            if kind == "cuda":
                self._idle.wait_for(lambda: all(r.in_use == 0 for r in gone))
        for region in gone:
            if kind == "cuda":
                region.memory.close()
            else:
                region.map.close()
                os.close(region.fd)

    def status(self, name: str | None = None, kind: str = "system") -> list[dict[str, Any]]:
        """Triton's status entries of ``kind``: every region, or ``name``'s (unknown:
        ``RegionNotFound``)."""
        with self._lock:
            table: dict[str, Any] = self._cuda if kind == "cuda" else self._regions
            if name is None:
                return [r.status(n) for n, r in sorted(table.items())]
            region = table.get(name)
        if region is None:
            label = "CUDA shared-memory" if kind == "cuda" else "shared-memory"
            raise RegionNotFound(f"{label} region {name!r} is not registered")
        return [region.status(name)]

    def close(self) -> None:
        for kind in KINDS:
            self.unregister(kind=kind)

    def for_device(self, device: Any) -> Regions:
        """The regions as a model whose inputs may stay on torch ``device`` reads them
        (None, or not a CUDA device: every input is copied to the host)."""
        if device is None or getattr(device, "type", None) != "cuda" or not self._cuda:
            return self
        return OnDevice(self, device)

    def _copied(self, tensor: str, path: str) -> None:
        with self._lock:
            self._copies[tensor, path] = self._copies.get((tensor, path), 0) + 1

    def figures(self) -> Iterator[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """Tensors copied between CUDA regions and models, by whether they stayed on the
        device, as a Prometheus family (``Metrics.collect``; none before the first)."""
        with self._lock:
            counts = sorted(self._copies.items())
        if counts:
            samples = [({"tensor": t, "path": p}, float(n)) for (t, p), n in counts]
            yield CUDA_COPIES, "counter", CUDA_COPIES_HELP, samples

    def cuda_device(self, name: str) -> int | None:
        """The device CUDA region ``name`` lies on (None: no such region)."""
        with self._lock:
            region = self._cuda.get(name)
        return None if region is None else region.memory.device_id

    def _span(self, ref: ShmRef, what: str) -> tuple[mmap.mmap, int]:
        """The region's map and where ``ref`` starts in it, once it lies inside."""
        region = self._regions.get(ref.region)
        if region is None:
            raise RegionNotFound(f"{what}: shared-memory region {ref.region!r} is not registered")
        _check_inside(ref, region.byte_size, what)
        start = region.offset + ref.offset
        # A client may shrink the object under us: reading past its end would be a SIGBUS.
        if os.fstat(region.fd).st_size < start + ref.byte_size:
            raise InvalidInput(
                f"{what}: region {ref.region!r}'s object shrank since it was registered"
            )
        return region.map, start

    @contextlib.contextmanager
    def _leased(self, ref: ShmRef, what: str) -> Iterator[CudaMemory | None]:
        """The CUDA region ``ref`` names, held for the copy (None: it names no CUDA region)."""
        with self._lock:
            region = self._cuda.get(ref.region)
            if region is not None:
                _check_inside(ref, region.byte_size, what)
                region.in_use += 1
        if region is None:
            yield None
            return
        try:
            yield region.memory
        finally:
            with self._lock:
                region.in_use -= 1
                self._idle.notify_all()

    def tensor(
        self, ref: ShmRef, name: str, datatype: str, shape: list[int], device: Any = None
    ) -> Any:
        from .kserve import tensor_from_raw

        count = _expected_bytes(ref, name, datatype, shape)
        what = f"input {name!r}"
        with self._leased(ref, what) as cuda:
            if cuda is not None:
                on_device = (
                    device is not None
                    and (device.index or 0) == cuda.device_id
                    and datatype != "BYTES"
                )
                try:
                    if on_device:
                        dtype = as_dtype(datatype).numpy
                        raw = cuda.to_device(ref.offset, ref.byte_size)
                        self._copied("input", "device")
                        return DeviceTensor(raw.view(torch_dtype(dtype)).reshape(shape), dtype)
                    raw = cuda.to_host(ref.offset, ref.byte_size)
                except Exception as exc:  # the copy's failure, said with what it was for
                    raise RunnerError(
                        f"{what}: copying from CUDA shared-memory region {ref.region!r}: {exc}"
                    ) from exc
                self._copied("input", "host")
                return tensor_from_raw(name, datatype, shape, memoryview(raw.data), count)
        with self._lock:
            view, start = self._span(ref, what)
            raw = view[start : start + ref.byte_size]  # a copy, made under the lock
        return tensor_from_raw(name, datatype, shape, memoryview(raw), count)

    def write(self, ref: ShmRef, name: str, raw: bytes | DeviceTensor) -> None:
        size = raw.nbytes if isinstance(raw, DeviceTensor) else len(raw)
        if size > ref.byte_size:
            raise no_room(name, size, ref)
        what = f"output {name!r}"
        with self._leased(ref, what) as cuda:
            if cuda is not None:
                try:
                    if isinstance(raw, DeviceTensor):
                        kept = cuda.from_tensor(ref.offset, raw.tensor)
                    else:
                        kept = False
                        cuda.from_host(ref.offset, raw)
                    self._copied("output", "device" if kept else "host")
                except Exception as exc:
                    raise RunnerError(
                        f"{what}: copying into CUDA shared-memory region {ref.region!r}: {exc}"
                    ) from exc
                return
        if isinstance(raw, DeviceTensor):
            raw = np.asarray(raw).tobytes()
        with self._lock:
            view, start = self._span(ref, what)
            view[start : start + len(raw)] = raw


def _check_inside(ref: ShmRef, size: int, what: str) -> None:
    if ref.offset + ref.byte_size > size:
        raise InvalidInput(
            f"{what}: offset {ref.offset} + byte_size {ref.byte_size} runs past the end "
            f"of region {ref.region!r} ({size} bytes)"
        )
