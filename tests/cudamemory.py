"""A stand-in for buffers on a GPU, for the CUDA shared-memory tests that run without one:
host bytes behind the interface ``cudashm.open_ipc``'s memory has (``CudaMemory``), and
torch's CPU tensors where a real buffer gives tensors on the device."""

from __future__ import annotations

import threading

import numpy as np

from servekit.errors import InvalidInput


class HostMemory:
    """A stand-in for a buffer on a device: host bytes; ``gate`` (when set) holds every
    read until it opens, as a long copy would."""

    def __init__(self, buffer: bytearray, device_id: int, byte_size: int) -> None:
        self.buffer, self.device_id, self.byte_size = buffer, device_id, byte_size
        self.closed = False
        self.gate: threading.Event | None = None
        self.writes = {"host": 0, "device": 0}
        """Outputs written from host bytes and from tensors kept on the device."""

    def to_host(self, start: int, size: int) -> np.ndarray:
        if self.gate is not None:
            self.gate.wait(10)
        assert not self.closed, "read after unmapping"
        return np.frombuffer(bytes(self.buffer[start : start + size]), np.uint8)

    def to_device(self, start: int, size: int):
        """The bytes as a torch tensor of their own: torch's CPU stands for the device."""
        import torch

        return torch.frombuffer(bytearray(self.to_host(start, size)), dtype=torch.uint8)

    def from_host(self, start: int, data: bytes) -> None:
        assert not self.closed, "write after unmapping"
        self.buffer[start : start + len(data)] = data
        self.writes["host"] += 1

    def from_tensor(self, start: int, tensor) -> bool:
        """What ``_IpcMemory`` copies device to device, counted apart from host writes."""
        assert not self.closed, "write after unmapping"
        data = tensor.contiguous().numpy().tobytes()
        self.buffer[start : start + len(data)] = data
        self.writes["device"] += 1
        return True

    def close(self) -> None:
        self.closed = True


class Devices:
    """Two stand-in devices; ``allocate`` returns a handle (64 bytes) and the buffer."""

    def __init__(self) -> None:
        self.buffers: dict[bytes, tuple[int, bytearray]] = {}
        self.opened: list[HostMemory] = []

    def allocate(self, size: int, device_id: int = 0) -> tuple[bytes, bytearray]:
        handle = len(self.buffers).to_bytes(8, "little") * 8
        self.buffers[handle] = (device_id, bytearray(size))
        return handle, self.buffers[handle][1]

    def open(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> HostMemory:
        if raw_handle not in self.buffers or self.buffers[raw_handle][0] != device_id:
            raise InvalidInput(f"CUDA shared-memory region {name!r}: its handle does not open")
        memory = HostMemory(self.buffers[raw_handle][1], device_id, byte_size)
        self.opened.append(memory)
        return memory
