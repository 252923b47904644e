"""CUDA's stream contract, in the one place servekit touches it.

Every GPU call of servekit's own (the runners' lanes, staging's pinned memory, device
decode, batches gathered on a device, CUDA shared memory) goes through ``Cuda``, and
follows its rules, PyTorch's CUDA semantics made explicit:

- Work runs on a stream servekit created, never on the legacy default stream, which
  synchronises with every blocking stream of the device. Every stream is non-blocking.
- A tensor made on one stream and read on another carries an event recorded where it was
  made (``device.DeviceTensor.ready``): the reader's stream waits on it (``wait``) and
  records its use (``hold``), so the caching allocator does not hand its block to the
  next batch while the reader still reads it.
- CUDA graphs are captured in ``thread_local`` mode under one lock per process, so a
  model loaded beside others that serve captures while they run.

``layer()`` is the process's ``Cuda``: PyTorch's, unless a test installed a model of the
device (``use``), which runs the same calls on the CPU and reports every access the
program did not order (``tests/fakecuda.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Cuda", "STICKY_ERRORS", "for_device", "is_sticky", "layer", "lose", "lost", "use"]

STICKY_ERRORS = (
    "illegal memory access",
    "illegal address",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "hardware stack error",
    "cudaerrorillegaladdress",
    "cudaerrorassert",
    "cudaerrorlaunchfailure",
)
"""CUDA's words for the errors after which every later call in the process fails (the
context is lost): only a new process serves again."""


def is_sticky(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception behind it) is one of CUDA's sticky errors."""
    e: BaseException | None = exc
    while e is not None:
        words = str(e).lower()
        if any(s in words for s in STICKY_ERRORS):
            return True
        e = e.__cause__
    return False


_LOST: str | None = None


def lose(reason: str) -> None:
    """This process's CUDA context is lost (a sticky error, ``reason``): every model it runs
    on a GPU is done for, and only a new process serves again (its liveness fails)."""
    global _LOST
    if _LOST is None:
        _LOST = reason


def lost() -> str | None:
    """Why this process's CUDA context is lost (``lose``); None while it serves."""
    return _LOST


@contextmanager
def lost_within() -> Iterator[None]:
    """A block whose lost device is forgotten at its end: a test that stands in a device
    raising CUDA's sticky words inside its own process."""
    global _LOST
    try:
        yield
    finally:
        _LOST = None


_CAPTURE = threading.Lock()
"""One CUDA graph capture at a time in the process."""


class Cuda:
    """PyTorch's CUDA as servekit uses it. Subclasses (a test's model of the device)
    replace the ``_`` methods; the rules live in the public ones."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def _torch(self) -> Any:
        import torch  # lazily: TensorRT's runner needs only ``runtime``

        return torch

    # ------------------------------------------------------------ devices and memory

    def available(self) -> bool:
        return bool(self._torch.cuda.is_available())

    def owns(self, device: Any) -> bool:
        """Whether ``device`` (a torch device) is one of this layer's GPUs."""
        return getattr(device, "type", None) == "cuda"

    def device(self, name: str | int = "cuda") -> Any:
        """The torch device tensors of ``name`` (``cuda``, ``cuda:N`` or N) live on."""
        return (
            self._torch.device("cuda", name) if isinstance(name, int) else self._torch.device(name)
        )

    def pinned(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised page-locked host tensor (the source of asynchronous copies)."""
        return self._torch.empty(shape, dtype=dtype, pin_memory=True)

    def empty_cache(self) -> None:
        self._torch.cuda.empty_cache()

    def runtime(self) -> Any:
        """cuda-python's runtime bindings (TensorRT's memory and streams, CUDA shared
        memory's copies)."""
        try:
            from cuda.bindings import runtime
        except ImportError:
            from cuda import cudart as runtime  # cuda-python < 12.6
        return runtime

    def driver(self) -> Any:
        """cuda-python's driver bindings (the size behind a CUDA IPC handle)."""
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver  # cuda-python < 12.6
        return driver

    def tensor_at(self, ptr: int, nbytes: int, device: Any) -> Any:
        """A torch uint8 tensor over ``nbytes`` of device memory at ``ptr`` (a buffer another
        process exported), no copy."""
        return self._torch.as_tensor(_Span(ptr, nbytes), device=device)

    # ------------------------------------------------------------------ streams

    def stream(self, device: Any) -> Any:
        """A new non-blocking stream on ``device`` (torch's pool streams are created with
        ``cudaStreamNonBlocking``): an instance's lane."""
        return self._torch.cuda.Stream(device)

    def side_stream(self, device: Any) -> Any:
        """This thread's own stream on ``device``, for servekit's work outside a lane
        (decoding, gathering a batch, CUDA shared memory): never the legacy default."""
        streams = self._local.__dict__.setdefault("streams", {})
        key = str(device)
        if key not in streams:
            streams[key] = self.stream(device)
        return streams[key]

    def external(self, handle: Any, device: Any) -> Any:
        """A stream made with CUDA's runtime (TensorRT's lane), as torch takes it."""
        return self._torch.cuda.ExternalStream(int(handle), device=device)

    @contextmanager
    def using(self, stream: Any) -> Iterator[Any]:
        """Run torch's work of the block on ``stream``."""
        with self._torch.cuda.stream(stream):
            yield stream

    def ready(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now: what a reader on another stream waits on."""
        event = self._torch.cuda.Event()
        event.record(stream)
        return event

    def current_ready(self, device: Any) -> Any:
        """An event recorded now on the calling thread's current stream on ``device``:
        where a caller's own tensor, handed over bare, was made."""
        return self.ready(self._torch.cuda.current_stream(device))

    def wait(self, stream: Any, event: Any) -> None:
        """``stream``'s later work waits until ``event`` (None: nothing to wait on)."""
        if event is not None:
            stream.wait_event(event)

    def hold(self, tensor: Any, stream: Any) -> None:
        """Tell the caching allocator ``stream`` uses ``tensor``, made on another stream:
        its block is not reused until ``stream``'s work so far is done."""
        tensor.record_stream(stream)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    # ------------------------------------------------------------------ graphs

    def capture(self, stream: Any, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """A CUDA graph of ``fn`` captured on ``stream`` and ``fn``'s outputs (its static
        outputs, rewritten by each replay). Captures in ``thread_local`` mode, one at a
        time in the process: other threads' CUDA work goes on meanwhile."""
        with _CAPTURE:
            return self._capture(stream, fn, "thread_local")

    def _capture(self, stream: Any, fn: Callable[[], Any], mode: str) -> tuple[Any, Any]:
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
            result = fn()
        return graph, result


class _Span:
    """Bytes on a device as torch takes them without a copy (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "strides": None,
            "version": 2,
        }  # fmt: skip


_LAYER: Cuda | None = None
_LAYER_LOCK = threading.Lock()


def layer() -> Cuda:
    """The process's ``Cuda`` (PyTorch's, made on first use)."""
    global _LAYER
    with _LAYER_LOCK:
        if _LAYER is None:
            _LAYER = Cuda()
        return _LAYER


def for_device(device: Any) -> Cuda | None:
    """The layer where ``device`` is one of its GPUs; None for host memory (or torch's CPU
    standing in for a device)."""
    if getattr(device, "type", None) == "cpu" and _LAYER is None:
        return None  # no layer made yet and none needed: nothing to import
    gpu = layer()
    return gpu if gpu.owns(device) else None


@contextmanager
def use(cuda: Cuda) -> Iterator[Cuda]:
    """Serve with ``cuda`` as the process's layer within the block (a model of the device
    in tests); the layer before it afterwards."""
    global _LAYER
    with _LAYER_LOCK:
        before, _LAYER = _LAYER, cuda
    try:
        yield cuda
    finally:
        with _LAYER_LOCK:
            _LAYER = before
