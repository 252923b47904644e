"""Request tensors that already live on a GPU (read from CUDA shared memory).

A ``DeviceTensor`` carries the numpy dtype and shape the signature checks
(``ModelSpec.validate_inputs``) and the torch tensor a runner on that device takes as it
is (``TorchRunner.tensor_device``). A batch of them is gathered on the device
(``gather_on_device``), never through host memory; anything that wants host memory
(``np.asarray``: the response cache's key, a runner on the host) gets a copy.

A request whose every output goes into CUDA shared memory on the same device marks its
inputs ``keep_outputs``; a batch made only of such requests is answered on the device
(``TorchRunner``), each request's rows a ``DeviceTensor`` written into its region device
to device (``protocol.shm.write_output``). Any other batch is answered on the host.

A ``DeviceTensor`` made by work on a stream carries the event recorded there when it
was made (``ready``); whoever reads it on another stream waits on that first and records
its use (``cuda``'s contract).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .cuda import for_device

__all__ = ["DeviceTensor", "gather_on_device", "on_host", "torch_dtype", "unwrap"]


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy one (torch imports lazily); no tensor is made."""
    import torch

    found = _TORCH_DTYPES.get(np.dtype(dtype).str)
    if found is None:
        found = _TORCH_DTYPES[np.dtype(dtype).str] = torch.from_numpy(np.empty(0, dtype)).dtype
    return found


_TORCH_DTYPES: dict[str, Any] = {}


class DeviceTensor:
    """A tensor on a torch device, with the numpy ``dtype`` and ``shape`` it stands for."""

    __slots__ = ("tensor", "dtype", "shape", "keep_outputs", "ready")

    def __init__(
        self, tensor: Any, dtype: np.dtype, keep_outputs: bool = False, ready: Any = None
    ) -> None:
        self.tensor = tensor
        self.dtype = np.dtype(dtype)
        self.shape: tuple[int, ...] = tuple(int(d) for d in tensor.shape)
        self.keep_outputs = keep_outputs
        """Whether the request this input belongs to wants its outputs on this device."""
        self.ready = ready
        """The event after which ``tensor`` is made (None: it was made when this was)."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> Any:
        return self.tensor.device

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> DeviceTensor:
        """Some rows, where they are (a view: ``batching.concat.split``)."""
        return DeviceTensor(self.tensor[rows], self.dtype, ready=self.ready)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """A host copy, made on this thread's own stream once the tensor is ready."""
        gpu = for_device(self.tensor.device)
        if gpu is None:
            host = self.tensor.cpu().numpy()
        else:
            stream = gpu.side_stream(self.tensor.device)
            gpu.wait(stream, self.ready)
            with gpu.using(stream):
                host = self.tensor.cpu().numpy()
                gpu.hold(self.tensor, stream)
            gpu.synchronize(stream)
        return host if dtype is None else host.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.dtype}, {list(self.shape)}, on {self.device})"


def unwrap(a: Any) -> Any:
    """A ``DeviceTensor`` as its torch tensor (taken where it is); anything else as it is."""
    return a.tensor if isinstance(a, DeviceTensor) else a


def on_host(a: Any) -> Any:
    """``a`` as a host array where it is a ``DeviceTensor`` (a copy); anything else as it is."""
    return np.asarray(a) if isinstance(a, DeviceTensor) else a


def gather_on_device(parts: Sequence[Any]) -> DeviceTensor:
    """One batch tensor, on the device of the first ``DeviceTensor`` among ``parts``, of
    every part's rows in order: device parts are copied there device to device, host
    arrays (a batch mixing CUDA shared memory with bytes sent over the wire) uploaded.
    It keeps its outputs on the device only where every part asked to.
    The memory comes from torch's caching allocator, which reuses its blocks once warm.
    On a GPU the gather runs on this thread's own stream, after every part is made; the
    batch is ready when its event is."""
    import torch

    first = next(p for p in parts if isinstance(p, DeviceTensor))
    keep = all(isinstance(p, DeviceTensor) and p.keep_outputs for p in parts)
    gpu = for_device(first.device)
    if gpu is None:
        return DeviceTensor(_cat(torch, parts, first.device), first.dtype, keep)
    stream = gpu.side_stream(first.device)
    for p in parts:
        if isinstance(p, DeviceTensor):
            gpu.wait(stream, p.ready)
    with gpu.using(stream):
        batch = _cat(torch, parts, first.device)
        for p in parts:
            if isinstance(p, DeviceTensor) and p.tensor is not batch:
                gpu.hold(p.tensor, stream)
    return DeviceTensor(batch, first.dtype, keep, ready=gpu.ready(stream))


def _cat(torch: Any, parts: Sequence[Any], device: Any) -> Any:
    tensors = [
        p.tensor if isinstance(p, DeviceTensor) else torch.from_numpy(np.ascontiguousarray(p))
        for p in parts
    ]
    tensors = [t.to(device) for t in tensors]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
