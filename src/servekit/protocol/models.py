"""What servekit's KServe v2 front serves: a declared contract instead of attribute probes.

A ``FrontModel`` is one served model as the front sees it: its signature, whether it
has versions of its own, the ``Batcher`` behind it (for metrics and scheduling) and
``infer`` with Triton's scheduling parameters; a ``PassThrough`` one also takes checked
request bodies on to the server behind it untouched. A ``ModelRegistry`` finds models by name
and answers their readiness. ``as_registry`` turns what app code has (Runners,
Batchers, a mapping of them) into these once, at construction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import numpy as np

from ..batching import Batcher
from ..batching.execute import as_error
from ..batching.sequence import SequenceFlags
from ..batching.sequencer import SequenceBatcher
from ..cuda import lost
from ..errors import InvalidInput, ModelNotFound, ServekitError
from ..runners.base import Runner, tensor_device
from ..runners.broken import broken
from ..spec import ModelSpec

__all__ = [
    "BatchedModel",
    "Decoupled",
    "DecoupledModel",
    "FrontModel",
    "ModelRegistry",
    "PassThrough",
    "PassThroughRegistry",
    "RepositoryControl",
    "RunnerModel",
    "SequencedModel",
    "VersionTarget",
    "StaticModels",
    "as_registry",
    "conforms",
    "decoupled_figures",
    "decoupled_refusal",
    "input_device",
    "lost_device",
    "unready_reason",
]

_T = TypeVar("_T")
_CONFORMS: dict[tuple[type, type], bool] = {}


def conforms(obj: object, protocol: type[_T]) -> TypeGuard[_T]:
    """``isinstance(obj, protocol)`` for a runtime-checkable protocol, remembered per type:
    probing every member again costs microseconds on each request."""
    key = (type(obj), protocol)
    known = _CONFORMS.get(key)
    if known is None:
        known = _CONFORMS[key] = isinstance(obj, protocol)
    return known


@runtime_checkable
class FrontModel(Protocol):
    """One model behind the front."""

    spec: ModelSpec
    versioned: bool
    """True: ``/versions/<v>/`` passes through to ``infer`` (the runtime owns versions);
    False: only version 1 exists."""
    versions: tuple[str, ...]
    """The versions served under this name, as metadata and the repository index list
    them; empty where the server behind answers for its own (tritonserver)."""

    @property
    def batcher(self) -> Batcher | SequenceBatcher | None:
        """The batcher whose counters the front exports as Triton's metrics, if any."""
        ...

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]: ...


@runtime_checkable
class PassThrough(Protocol):
    """A front model served by another server: once the front has checked a request, its
    body goes on to that server as it came, and the answer comes back as it is."""

    async def forward(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        timeout_us: int | None = None,
        sequence: SequenceFlags | None = None,
    ) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, headers) of the other server's answer; ``timeout_us``: the
        request's own timeout (KServe ``timeout``): its queue timeout in the front's
        window, its deadline for re-sending it if a worker dies; ``sequence``: the
        sequence it belongs to, if any."""
        ...

    def send(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        done: Callable[[tuple[int, bytes, dict[str, str]] | ServekitError], None],
        timeout_us: int | None = None,
        sequence: SequenceFlags | None = None,
    ) -> Callable[[], None] | None:
        """``forward`` without awaiting: ``done`` gets the answer, or the error, on the loop.
        Returns what to call if the client leaves first (None: nothing to do)."""
        ...


@runtime_checkable
class VersionTarget(Protocol):
    """One version of a routed model that another server answers for."""

    def pass_through(self) -> tuple[PassThrough, str] | None:
        """The model and version to send a checked request's bytes to, when that server's
        answer names the routed model and version as they are; else None (the request
        takes the full path)."""
        ...


@runtime_checkable
class PassThroughRegistry(Protocol):
    """A registry whose models another server serves (tritonserver): the front's Triton
    extension endpoints (model configuration, statistics, repository index) are answered
    by that server, as it has them."""

    async def fetch(self, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, headers) of the other server's answer to a bodiless request."""
        ...

    def peek(self, name: str) -> PassThrough | None:
        """The model ``name`` if it is known now, without waiting on anything (the front's
        fast path); None sends the request down the full path, which looks it up."""
        ...

    def serves(self, name: str) -> bool:
        """Whether that server answers for model ``name`` (its configuration, statistics,
        metadata and trace settings); False for a model the front serves itself."""
        ...

    async def control(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        """That server's answer to a model control request (``POST /v2/repository/models/
        <m>/load|unload``) with the client's own control header, or an error saying why
        it cannot take one."""
        ...

    async def restricted(
        self, method: str, path: str, body: bytes | None
    ) -> tuple[int, bytes, dict[str, str]]:
        """That server's answer to a request on one of its restricted APIs (shared memory,
        trace settings), sent with the front's own control headers once the front checked
        the client's token (for shared memory, that server maps and reads the regions)."""
        ...


@runtime_checkable
class ModelRegistry(Protocol):
    """The models a front serves, found by name (they may come and go)."""

    async def lookup(self, name: str) -> FrontModel:
        """The model, or ``ModelNotFound`` naming it."""
        ...

    async def is_ready(self, name: str, version: str | None) -> bool: ...

    def loaded(self) -> Mapping[str, FrontModel]:
        """The models known right now (for metrics)."""
        ...


@runtime_checkable
class RepositoryControl(Protocol):
    """A registry that answers Triton's model repository extension itself: the index with
    each model's state, and loads and unloads (``servekit.store``)."""

    def index(self) -> list[dict[str, Any]]:
        """``{"name", "version", "state", "reason"?}`` for every model known, loaded or not."""
        ...

    async def load(self, name: str, config: Mapping[str, Any] | None = None) -> None:
        """Load ``name``; ``config`` is Triton's model configuration JSON overriding its
        batching and instances (it reloads a loaded model)."""
        ...

    async def unload(self, name: str) -> None:
        """Unload ``name`` once the requests holding it are answered."""
        ...


def unready_reason(model: FrontModel) -> str | None:
    """Why ``model`` cannot serve although it is listed (its set-up failed, its device was
    lost: ``runners.broken``, or this process's CUDA context: ``cuda.lost``); None while
    it can. Readiness and the index read it."""
    return broken(model) or broken(model.batcher) or lost()


def lost_device() -> str | None:
    """``<model>: device lost: ...`` where a model running in this process lost its device
    to a sticky CUDA error (``cuda.lost``): the process serves no more (the liveness of
    native and of PyTriton, whose models run in servekit's process)."""
    return lost()


def input_device(model: object) -> Any:
    """The torch device a served model takes input tensors on as they are (its batcher's
    runner's, ``runners.base.tensor_device``); None where it takes host arrays. Inputs in
    CUDA shared memory on that device stay there."""
    return tensor_device(getattr(getattr(model, "batcher", None), "runner", None))


class BatchedModel:
    """A ``Batcher`` as a front model: requests are awaited on its loop, scheduling honoured."""

    versioned = False
    versions: tuple[str, ...] = ("1",)

    def __init__(self, batcher: Batcher) -> None:
        self.batcher: Batcher | None = batcher
        self.spec = batcher.spec

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        assert self.batcher is not None
        return await self.batcher.infer(inputs, priority=priority, timeout_us=timeout_us)


class SequencedModel:
    """A ``SequenceBatcher`` as a front model: requests name their sequence
    (``infer_in_sequence``); a plain ``infer`` names none and is refused as Triton does."""

    versioned = False
    versions: tuple[str, ...] = ("1",)

    def __init__(self, batcher: SequenceBatcher) -> None:
        self.batcher = batcher
        self.spec = batcher.spec

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        return await self.batcher.infer(inputs)

    async def infer_in_sequence(
        self, inputs: Mapping[str, np.ndarray], sequence: SequenceFlags | None
    ) -> dict[str, np.ndarray]:
        return await self.batcher.infer(inputs, sequence=sequence)


@runtime_checkable
class Decoupled(Protocol):
    """A front model answering a request with any number of responses (Triton's decoupled
    transaction policy): in this process (``DecoupledModel``) or behind tritonserver."""

    decoupled: bool
    spec: ModelSpec

    def responses(self, inputs: Mapping[str, np.ndarray]) -> AsyncIterator[dict[str, np.ndarray]]:
        """The responses to ``inputs``, as the model makes them."""
        ...


def decoupled_refusal(name: str) -> InvalidInput:
    """What a unary call to a decoupled model gets, as Triton refuses one."""
    return InvalidInput(
        f"model {name!r} is decoupled (it answers a request with any number of "
        "responses): call it over a gRPC stream (ModelStreamInfer) or over HTTP with "
        "'Accept: text/event-stream'"
    )


class DecoupledModel:
    """A decoupled model (Triton's decoupled transaction policy): ``responses`` gives any
    number of answers to one request, as the model makes them, each generator running on
    one of ``instances`` worker threads. A client that leaves stops the model at its next
    ``yield``; at most ``BUFFERED`` responses wait for a client that reads slowly. A plain
    ``infer`` is refused, as Triton refuses a unary call to such a model."""

    versioned = False
    versions: tuple[str, ...] = ("1",)
    batcher: Batcher | None = None
    decoupled = True
    BUFFERED = 16

    def __init__(self, runner: Runner, instances: int = 1, name: str = "model") -> None:
        import concurrent.futures
        import threading

        self.runner, self.name, self.spec = runner, name, runner.spec
        self._pool = concurrent.futures.ThreadPoolExecutor(
            instances, thread_name_prefix=f"servekit-{name}"
        )
        self._counting = threading.Lock()
        self.counts = {"requests": 0, "responses": 0, "abandoned": 0}
        """Requests taken, responses the model made, and requests whose client left
        before the model's last response (``decoupled_figures``)."""

    def _count(self, what: str) -> None:
        with self._counting:
            self.counts[what] += 1

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        raise decoupled_refusal(self.name)

    async def responses(
        self, inputs: Mapping[str, np.ndarray]
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """The model's responses to ``inputs`` as it yields them."""
        import threading

        self.spec.validate_inputs(inputs)
        self._count("requests")
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[Any] = asyncio.Queue()
        room = threading.Semaphore(self.BUFFERED)
        stop = threading.Event()

        def work() -> None:
            made = self.runner.responses(inputs)  # type: ignore[attr-defined]
            try:
                for outputs in made:
                    self._count("responses")
                    while not room.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    loop.call_soon_threadsafe(handed.put_nowait, outputs)
            except Exception as exc:
                loop.call_soon_threadsafe(handed.put_nowait, as_error(exc, self.name))
            finally:
                made.close()
                loop.call_soon_threadsafe(handed.put_nowait, _DONE)

        running = loop.run_in_executor(self._pool, work)
        finished = False
        try:
            while (item := await handed.get()) is not _DONE:
                room.release()
                if isinstance(item, ServekitError):
                    finished = True
                    raise item
                yield item
            finished = True
        finally:
            if not finished:  # the client left first
                self._count("abandoned")
            stop.set()
            room.release()
            del running

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_DONE = object()
"""The end of a decoupled model's responses."""

DECOUPLED_METRICS = {
    "requests": ("servekit_decoupled_requests_total", "Requests a decoupled model took"),
    "responses": ("servekit_decoupled_responses_total", "Responses a decoupled model made"),
    "abandoned": (
        "servekit_decoupled_abandoned_total",
        "Requests whose client left before the decoupled model's last response",
    ),
}


def decoupled_figures(
    models: Mapping[str, DecoupledModel],
) -> Iterator[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
    """Each decoupled model's counts as Prometheus families (``Metrics.collect``)."""
    for key, (name, about) in DECOUPLED_METRICS.items():
        samples = [({"model": m}, float(d.counts[key])) for m, d in sorted(models.items())]
        yield name, "counter", about, samples


class RunnerModel:
    """A plain Runner as a front model: each request runs alone on a worker thread."""

    versioned = False
    versions: tuple[str, ...] = ("1",)
    batcher: Batcher | None = None

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.spec = runner.spec

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        return await asyncio.get_running_loop().run_in_executor(None, self.runner.infer, inputs)


class StaticModels(Mapping[str, FrontModel]):
    """A fixed set of models (every runtime that loads its own), always ready once listed."""

    def __init__(self, models: Mapping[str, FrontModel]) -> None:
        self._models = dict(models)

    async def lookup(self, name: str) -> FrontModel:
        if name not in self._models:
            raise ModelNotFound(f"unknown model {name!r}; serving {sorted(self._models)}")
        return self._models[name]

    async def is_ready(self, name: str, version: str | None) -> bool:
        model = self._models.get(name)
        return model is not None and unready_reason(model) is None

    def loaded(self) -> Mapping[str, FrontModel]:
        return self._models

    def __getitem__(self, name: str) -> FrontModel:
        return self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)


def as_front_model(model: Any) -> FrontModel:
    """A Batcher, a Runner or a ``FrontModel`` as a ``FrontModel``."""
    if isinstance(model, Batcher):
        return BatchedModel(model)
    if isinstance(model, SequenceBatcher):
        return SequencedModel(model)
    if isinstance(model, FrontModel):
        return model
    if isinstance(model, Runner):
        return RunnerModel(model)
    raise TypeError(
        f"cannot serve {type(model).__name__}: expected a Batcher, Runner or FrontModel"
    )


def as_registry(models: Mapping[str, Any] | ModelRegistry) -> ModelRegistry:
    """A registry as is; a mapping of Batchers, Runners or front models as ``StaticModels``."""
    if isinstance(models, ModelRegistry):
        return models
    return StaticModels({name: as_front_model(m) for name, m in models.items()})
