"""Request tensors that already live on a GPU (read from CUDA shared memory).

A ``DeviceTensor`` carries the numpy dtype and shape the signature checks
(``ModelSpec.validate_inputs``) and the torch tensor a runner on that device takes as it
is (``TorchRunner.tensor_device``). A batch of them is gathered on the device
(``gather_on_device``), never through host memory; anything that wants host memory
(``np.asarray``: the response cache's key, a runner on the host) gets a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DeviceTensor", "gather_on_device", "torch_dtype", "unwrap"]


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy one (torch imports lazily)."""
    import torch

    return torch.from_numpy(np.empty(0, dtype)).dtype


class DeviceTensor:
    """A tensor on a torch device, with the numpy ``dtype`` and ``shape`` it stands for."""

    __slots__ = ("tensor", "dtype", "shape")

    def __init__(self, tensor: Any, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.dtype = np.dtype(dtype)
        self.shape: tuple[int, ...] = tuple(int(d) for d in tensor.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> Any:
        return self.tensor.device

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self.tensor.cpu().numpy()
        return host if dtype is None else host.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.dtype}, {list(self.shape)}, on {self.device})"


def unwrap(a: Any) -> Any:
    """A ``DeviceTensor`` as its torch tensor (taken where it is); anything else as it is."""
    return a.tensor if isinstance(a, DeviceTensor) else a


def gather_on_device(parts: Sequence[Any]) -> Any:
    """One batch tensor, on the device of the first ``DeviceTensor`` among ``parts``, of
    every part's rows in order: device parts are copied there device to device, host
    arrays (a batch mixing CUDA shared memory with bytes sent over the wire) uploaded.
    The memory comes from torch's caching allocator, which reuses its blocks once warm."""
    import torch

    device = next(p.device for p in parts if isinstance(p, DeviceTensor))
    tensors = [
        p.tensor if isinstance(p, DeviceTensor) else torch.from_numpy(np.ascontiguousarray(p))
        for p in parts
    ]
    tensors = [t.to(device) for t in tensors]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
