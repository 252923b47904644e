"""A model of CUDA's asynchrony on the CPU, for the tests of servekit's GPU path.

``FakeCuda`` is a ``servekit.cuda.Cuda``: installed with ``servekit.cuda.use``, the
runners' own code (lanes, staging, graph capture, device decode, batches gathered on the
device, TensorRT's lanes through ``FakeRuntime``) runs against it with torch's CPU
tensors standing for device memory. What it models:

- **Streams run in order, and apart.** Every torch op in a servekit stream's block is an
  access by that stream at its next position; an asynchronous copy (``copy_`` with
  ``non_blocking``, ``cudaMemcpyAsync``) takes effect only when its stream is waited on,
  synchronised or runs its next op, so a reader that did not wait reads the old bytes.
- **Order is only what the program made.** Each stream keeps a vector clock; an event
  carries its stream's clock, ``wait`` merges it, ``synchronize`` merges into the host's,
  which every later launch inherits. An access not ordered after the last write of its
  memory (or a write not ordered after its reads) is a race, raised as ``Race`` at once,
  as PyTorch's CUDA sanitizer reports (``TORCH_CUDA_SANITIZER=1``).
- **A caching allocator that reuses a freed block at once.** When a tensor's memory is
  freed, any use of it by a stream other than the one it was made on that was neither
  ordered before that stream nor recorded (``record_stream``) is a use after free.
- **Pinned memory poisoned when freed** (``FakeRuntime.cudaFreeHost``): its bytes become
  0xFF (NaN as floats) and a copy from or into it is refused.
- **Graph capture in global mode fails on any CUDA call from another thread**, as
  ``cudaStreamBeginCapture`` with ``cudaStreamCaptureModeGlobal`` does.
- **The legacy default stream**: any work on it (torch's current stream outside servekit's
  streams, ``cudaMemcpy``, stream 0) is counted in ``legacy``; a blocking stream
  (``cudaStreamCreate``) is counted in ``blocking``.

Everything it reports also goes to ``problems``, which the fixture asserts is empty.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from servekit.cuda import Cuda


class Race(AssertionError):
    """Two accesses to one memory that the program did not order."""


class Stream:
    """One stream: its position, its vector clock, its copies not yet done."""

    def __init__(self, device: FakeCuda, sid: int, name: str, blocking: bool = False) -> None:
        self.fake, self.sid, self.name, self.blocking = device, sid, name, blocking
        self.seq = 0
        self.clock: dict[int, int] = {}
        self.pending: list[Callable[[], None]] = []
        self.cuda_stream = sid  # the handle CUDA's runtime would give

    def synchronize(self) -> None:
        self.fake.synchronize(self)

    def wait_event(self, event: Event) -> None:
        self.fake.wait(self, event)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class Event:
    """A point on a stream: its clock when recorded."""

    def __init__(self, fake: FakeCuda, stream: Stream) -> None:
        self.fake, self.stream = fake, stream
        self.clock = dict(stream.clock)

    def synchronize(self) -> None:
        with self.fake._lock:
            self.fake._flush(self.stream)
            _merge(self.fake.host, self.clock)


def _merge(into: dict[int, int], clock: dict[int, int]) -> None:
    for k, v in clock.items():
        if into.get(k, 0) < v:
            into[k] = v


def _see(block: _Block, tensor: torch.Tensor) -> None:
    """One more of the program's tensors over ``block`` (ids of dead tensors are reused)."""
    ref = block.seen.get(id(tensor))
    if ref is None or ref() is not tensor:
        block.seen[id(tensor)] = weakref.ref(tensor)


class _Block:
    """What the tracker knows of one storage: who made it, its last write, reads since."""

    __slots__ = ("ref", "made_on", "write", "reads", "users", "recorded", "what", "seen", "jobs")

    def __init__(self, ref: StorageWeakRef, made_on: int, what: str) -> None:
        self.ref, self.made_on, self.what = ref, made_on, what
        self.seen: dict[int, weakref.ref[torch.Tensor]] = {}
        """The program's tensors over this memory: once all are gone while only the fake's
        own queued copies (``jobs`` of them) hold it, it is freed (CUDA holds nothing)."""
        self.jobs = 0
        self.write: tuple[int, int] | None = None
        self.reads: list[tuple[int, int]] = []
        self.users: dict[int, int] = {}  # stream -> its last position using this block
        self.recorded: set[int] = set()


class FakeCuda(Cuda):
    """The model of a device; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.default = Stream(self, 0, "legacy-default", blocking=True)
        self.streams: dict[int, Stream] = {0: self.default}
        self.host: dict[int, int] = {}
        self._current = threading.local()
        self._blocks: dict[int, _Block] = {}
        self.problems: list[str] = []
        self.legacy = 0
        self.legacy_ops: list[str] = []
        """What ran on the legacy default stream (op, thread)."""
        self.blocking = 0
        self.capturing: tuple[threading.Thread, str] | None = None
        self.captures = 0
        self.capture_hold_s = 0.0
        """How long a capture stays open waiting for another thread's CUDA call (a long
        capture, made deterministic)."""
        self._crossed = threading.Event()
        self._invalidated = False
        self.closed = False
        self._runtime: FakeRuntime | None = None

    # ------------------------------------------------------------ the Cuda layer

    def available(self) -> bool:
        return True

    def owns(self, device: Any) -> bool:
        return not self.closed

    def device(self, name: str | int = "cuda") -> Any:
        return torch.device("cpu")

    def pinned(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return torch.empty(shape, dtype=dtype)

    def empty_cache(self) -> None:
        pass

    def runtime(self) -> Any:
        if self._runtime is None:
            self._runtime = FakeRuntime(self)
        return self._runtime

    def driver(self) -> Any:
        return self.runtime()  # the one driver call servekit makes is FakeRuntime's too

    def tensor_at(self, ptr: int, nbytes: int, device: Any) -> Any:
        raw = (ctypes.c_byte * max(nbytes, 1)).from_address(int(ptr))
        return torch.from_numpy(np.frombuffer(raw, np.uint8, count=nbytes))

    def stream(self, device: Any) -> Stream:
        return self.new_stream("servekit")

    def new_stream(self, name: str, blocking: bool = False) -> Stream:
        with self._lock:
            sid = next(self._ids)
            s = Stream(self, sid, f"{name}-{sid}", blocking)
            _merge(s.clock, self.host)
            self.streams[sid] = s
            if blocking:
                self.blocking += 1
            return s

    def external(self, handle: Any, device: Any) -> Stream:
        return self.streams[int(handle)]

    def current(self) -> Stream:
        return getattr(self._current, "stream", None) or self.default

    @contextmanager
    def using(self, stream: Any) -> Iterator[Any]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        self._track_thread()
        try:
            yield stream
        finally:
            self._current.stream = before

    def ready(self, stream: Any) -> Event:
        with self._lock:
            return Event(self, stream)

    def current_ready(self, device: Any) -> Event:
        return self.ready(self.current())

    def wait(self, stream: Any, event: Any) -> None:
        if event is None:
            return
        with self._lock:
            self._flush(event.stream)
            _merge(stream.clock, event.clock)

    def hold(self, tensor: Any, stream: Any) -> None:
        with self._lock:
            block = self._block(tensor, self.current().sid)
            block.recorded.add(stream.sid)

    def synchronize(self, stream: Any) -> None:
        with self._lock:
            self._flush(stream)
            clock = dict(stream.clock)
            clock[stream.sid] = stream.seq
            _merge(self.host, clock)

    def _capture(self, stream: Any, fn: Callable[[], Any], mode: str) -> tuple[Any, Any]:
        with self._lock:
            if self.capturing is not None:
                self._report("a capture began while another one ran")
            self.capturing = (threading.current_thread(), mode)
            self._crossed.clear()
        try:
            with self.using(stream):
                result = fn()
            if self.capture_hold_s:
                self._crossed.wait(self.capture_hold_s)
            self._check_capture()
            self.synchronize(stream)  # a capture records the work; none of it is pending
        finally:
            with self._lock:
                self.capturing = None
                self.captures += 1
        return _Graph(self, stream, fn, result), result

    # --------------------------------------------------------------- the model

    def _track_thread(self) -> None:
        """Every torch op of this thread is seen from now on (on the default stream
        outside servekit's streams) while this fake is the one tracked."""
        global _TRACKED
        _TRACKED = self
        if not getattr(_THREADS, "tracker", None):
            _THREADS.tracker = _Tracker()
            _THREADS.tracker.__enter__()  # for the life of the thread

    def _report(self, problem: str) -> None:
        self.problems.append(problem)
        raise Race(problem)

    def _flush(self, stream: Stream) -> None:
        pending, stream.pending = stream.pending, []
        for job in pending:
            job()

    def _check_capture(self) -> None:
        if self.capturing is None:
            return
        thread, mode = self.capturing
        if thread is threading.current_thread():
            if self._invalidated:
                self._invalidated = False
                self._report("the capture was invalidated by another thread's CUDA call")
            return
        self._crossed.set()
        if mode == "global":
            self._invalidated = True
            self._report(
                "a CUDA call from another thread during a capture in global mode "
                "(cudaErrorStreamCaptureUnsupported): the capture is invalidated"
            )

    def _block(self, tensor: torch.Tensor, made_on: int, what: str = "") -> _Block:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        block = self._blocks.get(key)
        if block is None or block.ref.expired():
            if block is not None:  # its memory was freed and made again since the last look
                self._retire(key, block)
            what = what or f"a tensor of {list(tensor.shape)} {str(tensor.dtype)[6:]}"
            block = _Block(StorageWeakRef(storage), made_on, what)
            self._blocks[key] = block
        _see(block, tensor)
        return block

    def _made(self, tensor: torch.Tensor, stream: Stream, access: bool = True) -> None:
        """An op's output: new memory is made by ``stream`` (written, unless only allocated:
        ``access`` False); a view of known memory is one more of the program's tensors."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if not key:
            return
        block = self._blocks.get(key)
        if block is None or block.ref.expired():
            block = self._block(tensor, stream.sid)
            if access:
                block.write = (stream.sid, stream.seq)
                block.users[stream.sid] = stream.seq
        else:
            _see(block, tensor)

    def _ordered(self, access: tuple[int, int], stream: Stream) -> bool:
        sid, seq = access
        return sid == stream.sid or stream.clock.get(sid, 0) >= seq

    def _access(self, stream: Stream, reads: list[Any], writes: list[Any], op: str) -> None:
        """One op of ``stream``: check its reads and writes against what came before."""
        self._check_capture()
        self._free_expired()
        self._flush(stream)
        _merge(stream.clock, self.host)
        stream.seq += 1
        stream.clock[stream.sid] = stream.seq
        here = (stream.sid, stream.seq)
        if stream is self.default:
            self.legacy += 1
            self.legacy_ops.append(f"{op} in {threading.current_thread().name}")
        for t in reads:
            if not t.untyped_storage().data_ptr():
                continue  # no memory (an empty tensor)
            block = self._block(t, stream.sid)
            if block.write is not None and not self._ordered(block.write, stream):
                self._report(
                    f"{op} on {stream.name} reads {block.what} written on "
                    f"{self.streams[block.write[0]].name} without waiting for it"
                )
            block.reads.append(here)
            block.users[stream.sid] = stream.seq
        for t in writes:
            if not t.untyped_storage().data_ptr():
                continue
            block = self._block(t, stream.sid)
            for prior in ([block.write] if block.write else []) + block.reads:
                if not self._ordered(prior, stream):
                    self._report(
                        f"{op} on {stream.name} writes {block.what} while "
                        f"{self.streams[prior[0]].name} may still use it"
                    )
            block.write, block.reads = here, []
            block.users[stream.sid] = stream.seq

    def _free_expired(self) -> None:
        """Blocks whose memory was freed: a use that the caching allocator could not know
        of (another stream's, not recorded, not ordered before the block's own stream)
        is a use after free: the block is the next allocation's at once."""
        for key, block in list(self._blocks.items()):
            held = any(r() is not None for r in block.seen.values())
            if block.ref.expired() or (block.jobs and not held):
                self._retire(key, block)

    def _retire(self, key: int, block: _Block) -> None:
        """``block``'s memory is free: check the uses the allocator could not know of."""
        if self._blocks.get(key) is block:
            del self._blocks[key]
        owner = self.streams[block.made_on]
        for sid, seq in block.users.items():
            if sid == block.made_on or sid in block.recorded:
                continue
            done = self.host.get(sid, 0) >= seq or owner.clock.get(sid, 0) >= seq
            if not done:
                self.problems.append(
                    f"{block.what} freed (made on {owner.name}) while "
                    f"{self.streams[sid].name} may still use it: no record_stream"
                )

    def check(self) -> None:
        """Look for freed memory now (``gc`` has run), as the next op would."""
        with self._lock:
            self._free_expired()

    def close(self) -> None:
        """Stop tracking: threads that keep the tracker see every op pass through."""
        with self._lock:
            self.closed = True
            self._free_expired()


_TRACKED: FakeCuda | None = None
"""The fake device whose model sees torch's ops (the latest one used)."""
_THREADS = threading.local()


class _Tracker(TorchDispatchMode):
    """Sees every torch op of a thread that used a fake device (one per thread, for the
    life of the thread: it passes ops through when no open fake is tracked)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fake = _TRACKED
        if fake is None or fake.closed or getattr(_QUIET, "on", False):
            return func(*args, **kwargs)
        schema = func._schema
        if func in _ALLOCATIONS or _is_view(schema):  # no work on a stream: metadata, memory
            out = func(*args, **kwargs)
            with fake._lock:
                for o in out if isinstance(out, list | tuple) else [out]:
                    if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr():
                        fake._made(o, fake.current(), access=False)
            return out
        reads, writes = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [v for v in (value if isinstance(value, list | tuple) else [value])
                       if isinstance(v, torch.Tensor)]  # fmt: skip
            if arg.alias_info is not None and arg.alias_info.is_write:
                writes += tensors
            else:
                reads += tensors
        with fake._lock:
            stream = fake.current()
            name = str(func.__name__)
            deferred = func is torch.ops.aten.copy_.default and (
                args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            )
            fake._access(stream, reads, writes, name)
            if deferred:  # an asynchronous copy: done when its stream next runs or is waited on
                alias = torch.ops.aten.alias.default
                dst, src = _plain(alias, args[0]), _plain(alias, args[1])
                held = [fake._block(t, stream.sid) for t in args[:2]]
                for block in held:
                    block.jobs += 1

                def copy() -> None:
                    _plain(torch.ops.aten.copy_.default, dst, src)
                    for block in held:
                        block.jobs -= 1

                stream.pending.append(copy)
                return args[0]
        out = func(*args, **kwargs)
        with fake._lock:
            made = [o for o in (out if isinstance(out, list | tuple) else [out])
                    if isinstance(o, torch.Tensor)]  # fmt: skip
            for o in made:
                fake._made(o, stream)
        return out


_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
}
"""Allocations: memory of the current stream's pool, no work on it."""


def _is_view(schema: Any) -> bool:
    """An op that only makes a view (its outputs alias an input, nothing is written)."""
    returns = schema.returns
    return (
        bool(returns)
        and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    )


_QUIET = threading.local()


def _plain(func: Any, *args: Any) -> Any:
    """Run ``func`` untracked (the tracker's own work, deferred or not)."""
    before = getattr(_QUIET, "on", False)
    _QUIET.on = True
    try:
        return func(*args)
    finally:
        _QUIET.on = before


class _Graph:
    """A captured graph: a replay runs the captured work again on the replaying stream,
    writing into the outputs the capture made (the static buffers)."""

    def __init__(self, fake: FakeCuda, stream: Stream, fn: Callable[[], Any], result: Any) -> None:
        self.fake, self.fn, self.result = fake, fn, result

    def replay(self) -> None:
        fresh = self.fn()
        pairs = zip(
            self.result if isinstance(self.result, list | tuple) else [self.result],
            fresh if isinstance(fresh, list | tuple) else [fresh],
            strict=True,
        )
        for static, value in pairs:
            static.copy_(value)


class FakeRuntime:
    """The calls of CUDA's runtime (cuda-python's shape: ``(error, value...)``) that
    servekit's TensorRT runner and CUDA shared memory make, on the fake device: device and
    pinned memory are host memory at real addresses; copies are queued on their stream."""

    cudaStreamNonBlocking = 1

    class cudaMemcpyKind:  # noqa: N801  (CUDA's name)
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self._memory: dict[int, np.ndarray] = {}
        self.freed: dict[int, int] = {}  # pinned address -> bytes, poisoned

    def _alloc(self, nbytes: int) -> int:
        buf = np.zeros(max(int(nbytes), 1), np.uint8)
        ptr = buf.ctypes.data
        self._memory[ptr] = buf
        self.freed.pop(ptr, None)
        return ptr

    def cudaSetDevice(self, device: int) -> tuple[int]:
        return (0,)

    def cudaGetDeviceProperties(self, device: int) -> tuple[int, Any]:
        class Props:
            name, major, minor = b"Fake GPU", 9, 0

        return 0, Props()

    def cudaMalloc(self, nbytes: int) -> tuple[int, int]:
        return 0, self._alloc(nbytes)

    def cudaMallocHost(self, nbytes: int) -> tuple[int, int]:
        return 0, self._alloc(nbytes)

    def cudaFree(self, ptr: int) -> tuple[int]:
        self._memory.pop(int(ptr), None)
        return (0,)

    def cudaFreeHost(self, ptr: int) -> tuple[int]:
        buf = self._memory.get(int(ptr))
        if buf is None:
            self.fake.problems.append(f"cudaFreeHost of {ptr:#x}, not allocated")
            return (1,)
        buf[:] = 0xFF  # poisoned; kept mapped so a use after free reads NaN, not a crash
        self.freed[int(ptr)] = buf.nbytes
        return (0,)

    def _check_live(self, ptr: int, nbytes: int, what: str) -> None:
        for start, size in self.freed.items():
            if start <= ptr < start + size or ptr <= start < ptr + nbytes:
                self.fake._report(f"{what} touches pinned memory freed at {start:#x}")

    def cudaStreamCreate(self) -> tuple[int, int]:
        return 0, self.fake.new_stream("cudaStreamCreate", blocking=True).sid

    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[int, int]:
        blocking = not (flags & self.cudaStreamNonBlocking)
        return 0, self.fake.new_stream("runtime", blocking=blocking).sid

    def cudaStreamDestroy(self, handle: int) -> tuple[int]:
        return (0,)

    def cudaStreamSynchronize(self, handle: int) -> tuple[int]:
        stream = self.fake.streams[int(handle)]
        if stream is self.fake.default:
            self.fake.legacy += 1
        self.fake.synchronize(stream)
        return (0,)

    def cudaMemcpy(self, dst: int, src: int, nbytes: int, kind: int) -> tuple[int]:
        self.fake.legacy += 1
        ctypes.memmove(int(dst), int(src), int(nbytes))
        return (0,)

    def cudaMemcpyAsync(
        self, dst: int, src: int, nbytes: int, kind: int, handle: int
    ) -> tuple[int]:
        fake = self.fake
        stream = fake.streams[int(handle)]
        dst, src, nbytes = int(dst), int(src), int(nbytes)
        self._check_live(src, nbytes, "a copy from")
        self._check_live(dst, nbytes, "a copy into")
        with fake._lock:
            fake._access(stream, [], [], "cudaMemcpyAsync")

            def copy() -> None:
                self._check_live(src, nbytes, "a copy (when it ran) from")
                ctypes.memmove(dst, src, nbytes)

            stream.pending.append(copy)
        return (0,)

    def enqueue(self, handle: int, job: Callable[[], None]) -> None:
        """Work of a fake engine on a stream, done when the stream next runs or syncs."""
        fake = self.fake
        stream = fake.streams[int(handle)]
        with fake._lock:
            fake._access(stream, [], [], "execute_async_v3")
            stream.pending.append(job)

    def cudaGetErrorString(self, err: int) -> tuple[int, bytes]:
        return 0, b"fake CUDA error"

    # CUDA IPC: a handle is the buffer's address in its first 8 bytes (one process here).
    cudaIpcMemLazyEnablePeerAccess = 1

    class cudaIpcMemHandle_t:  # noqa: N801  (CUDA's name)
        def __init__(self) -> None:
            self.raw = ctypes.create_string_buffer(64)

        def getPtr(self) -> int:  # noqa: N802
            return ctypes.addressof(self.raw)

    @staticmethod
    def export(ptr: int) -> bytes:
        """The 64-byte handle a client would send for the buffer at ``ptr``."""
        return int(ptr).to_bytes(8, "little") + bytes(56)

    def cudaIpcOpenMemHandle(self, handle: Any, flags: int) -> tuple[int, int]:
        ptr = int.from_bytes(handle.raw.raw[:8], "little")
        return (0, ptr) if ptr in self._memory else (1, 0)

    def cudaIpcCloseMemHandle(self, ptr: int) -> tuple[int]:
        return (0,)

    def cuMemGetAddressRange(self, ptr: int) -> tuple[int, int, int]:
        for start, buf in self._memory.items():
            if start <= int(ptr) < start + buf.nbytes:
                return 0, start, buf.nbytes
        return 1, 0, 0
