"""Your own Python model: a ``Model`` subclass or an ``infer_function``, served like any
other, named in the config by import path (``source = "mypkg.models:Sentiment"``).

A model declares its signature (``inputs``, ``outputs``, ``max_batch_size``), receives
its ``[models.args]`` in ``setup`` in the process that serves it, and answers a batch
(a dict of arrays, batch dimension first) with a dict of arrays; ``infer`` may be
``async def``. ``UserRunner`` makes either a ``Runner``, so batching, versions, metrics
and every runtime apply unchanged; any ``Runner`` class is servable by import path too.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from .errors import InvalidInput, RunnerError, ServekitError, SetupFailed
from .runners.base import Arrays, BaseRunner, Runner
from .spec import ModelSpec, TensorSpec

__all__ = ["Model", "UserRunner", "import_model", "infer_function", "is_import_path"]

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

TensorLike = TensorSpec | tuple[str, Any, Sequence[int]]
"""A declared tensor: a ``TensorSpec`` or ``(name, dtype, dims)``, dims without the batch."""


def is_import_path(source: str) -> bool:
    """Whether ``source`` names Python code (``module:attribute``), not a zoo model or file."""
    return bool(_IMPORT_PATH.match(source)) and not os.path.exists(source)


class Model:
    """Subclass to serve your own code. Declare the signature as class attributes::

        class Sentiment(servekit.Model):
            inputs = [("TEXT", "BYTES", [1])]
            outputs = [("SCORE", "FP32", [1])]
            max_batch_size = 32

            def setup(self, vocab: str) -> None:     # the [models.args], once per instance
                self.words = load(vocab)

            def infer(self, batch):                  # or: async def infer(self, batch)
                return {"SCORE": score(self.words, batch["TEXT"])}

    Raise ``servekit.InvalidInput`` for a request's fault (a 400 naming it); any other
    exception fails the batch's requests with a 500 naming the model and the exception.

    A **decoupled** model (``decoupled = True``, Triton's decoupled transaction policy)
    answers each request with any number of responses: its ``infer`` is a generator (or
    an async generator) over one request's inputs, yielding a dict of outputs per
    response; it is served over gRPC streams and Server-Sent Events, and stopped at its
    next ``yield`` when its client leaves.
    """

    inputs: ClassVar[Sequence[TensorLike]] = ()
    outputs: ClassVar[Sequence[TensorLike]] = ()
    max_batch_size: ClassVar[int] = 0
    """0: no batch dimension (one request per call)."""
    decoupled: ClassVar[bool] = False
    """True: ``infer`` is a generator answering one request with any number of responses."""
    accelerated: ClassVar[bool] = False
    """True: ``infer`` runs its batch on a GPU or another device, leaving the host's cores
    free meanwhile; the Triton runtimes then hand the next batch over while it runs
    (``[models] overlap``'s default)."""

    def setup(self, **args: Any) -> None:
        """Load what the model needs (``[models.args]`` as keyword arguments)."""

    def infer(self, batch: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} must define infer(self, batch)")

    def warmup(self) -> None:
        """Called once before serving; the default runs one sample batch."""

    def close(self) -> None:
        """Release what ``setup`` took."""

    def end_sequence(self, sequence_id: int | str, reason: str) -> None:
        """A sequence ended (served with ``sequence_batching``): ``reason`` is "end" (its
        END ran), "idle" (nothing for ``max_sequence_idle_us``) or "cancelled" (its client
        left). Free what you keep for it; called after its last batch, on its instance."""


def infer_function(
    *,
    inputs: Sequence[TensorLike],
    outputs: Sequence[TensorLike],
    max_batch_size: int = 0,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a plain function's signature so it can be served. The function receives the
    batch as keyword arrays, as PyTriton's ``@batch`` infer functions do (or as one dict,
    where it takes a single positional parameter), and returns a dict of arrays."""

    def declare(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.servekit_signature = ModelSpec(  # type: ignore[attr-defined]
            _tensors(inputs, fn), _tensors(outputs, fn), max_batch_size
        )
        return fn

    return declare


def _tensors(declared: Sequence[TensorLike], owner: object) -> tuple[TensorSpec, ...]:
    out = []
    for t in declared:
        if isinstance(t, TensorSpec):
            out.append(t)
            continue
        try:
            name, dtype, dims = t
            out.append(TensorSpec(name, dtype, dims))
        except (TypeError, ValueError, ServekitError) as exc:
            raise ValueError(
                f"{_label(owner)}: tensor {t!r} is not (name, dtype, dims): {exc}"
            ) from None
    return tuple(out)


def _label(owner: object) -> str:
    target = owner if inspect.isclass(owner) or callable(owner) else type(owner)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', target)}"


def _takes_dict(fn: Callable[..., Any], spec: ModelSpec) -> bool:
    """Whether ``fn`` takes the batch as one dict: a single parameter that is not named
    after the inputs (``def f(X)`` for input ``X`` takes keywords, as ``def f(**inputs)``)."""
    params = list(inspect.signature(fn).parameters.values())
    names = {p.name for p in params}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return False
    if {t.name for t in spec.inputs} <= names:
        return False
    return len(params) == 1


class UserRunner(BaseRunner):
    """A ``Model`` instance or an ``infer_function`` as a ``Runner``: its outputs are checked
    (name, dtype, rows) and its failures become ``RunnerError`` naming ``name``."""

    def __init__(self, model: Model | Callable[..., Any], name: str = "") -> None:
        self.model, self.name = model, name or _label(model)
        if isinstance(model, Model):
            cls = type(model)
            if not cls.inputs or not cls.outputs:
                raise ValueError(f"{self.name}: declares no inputs or no outputs")
            self._spec = ModelSpec(
                _tensors(cls.inputs, cls), _tensors(cls.outputs, cls), int(cls.max_batch_size)
            )
            fn: Callable[..., Any] = model.infer
            self._call = fn
            streams = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
            if streams != bool(cls.decoupled):
                raise ValueError(
                    f"{self.name}: decoupled = True needs infer to be a generator (yield each "
                    "response)"
                    if cls.decoupled
                    else f"{self.name}: infer is a generator: set decoupled = True to stream "
                    "its responses"
                )
        else:
            spec = getattr(model, "servekit_signature", None)
            if not isinstance(spec, ModelSpec):
                raise ValueError(
                    f"{self.name}: a function needs its signature: decorate it with "
                    "@servekit.infer_function(inputs=..., outputs=..., max_batch_size=...)"
                )
            self._spec = spec
            fn = model
            self._call = fn if _takes_dict(fn, spec) else (lambda batch: fn(**batch))
        self._is_async = inspect.iscoroutinefunction(fn)
        self.decoupled = isinstance(model, Model) and type(model).decoupled
        self.accelerated = bool(getattr(model, "accelerated", False))
        self._local = threading.local()
        self._loops: list[asyncio.AbstractEventLoop] = []

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        result = self._call(dict(inputs))
        if self._is_async or inspect.isawaitable(result):
            result = self._loop().run_until_complete(result)
        if not isinstance(result, Mapping):
            raise RunnerError(
                f"{self.name}: infer must return a dict of output arrays, got "
                f"{type(result).__name__}"
            )
        return dict(result)

    def _loop(self) -> asyncio.AbstractEventLoop:
        """This worker thread's own event loop for an ``async def infer``."""
        loop = getattr(self._local, "loop", None)
        if loop is None:
            loop = self._local.loop = asyncio.new_event_loop()
            self._loops.append(loop)
        return loop

    def responses(self, inputs: Mapping[str, np.ndarray]) -> Iterator[Arrays]:
        """A decoupled model's responses to one request (validated by its caller), each
        checked as it comes; blocking, for a worker thread. Closing the iterator closes
        the model's generator at its next ``yield``."""
        if not self.decoupled:
            raise InvalidInput(f"model {self.name} is not decoupled: it answers once (infer)")
        rows = len(next(iter(inputs.values()))) if self.spec.batched else 1
        made = self._call(dict(inputs))
        if inspect.isasyncgen(made):
            made = self._drive(made)
        try:
            for outputs in made:
                if not isinstance(outputs, Mapping):
                    raise RunnerError(
                        f"{self.name}: each response must be a dict of output arrays, got "
                        f"{type(outputs).__name__}"
                    )
                self.spec.check_outputs(outputs, rows)
                yield dict(outputs)
        except ServekitError:
            raise
        except Exception as exc:
            raise RunnerError(f"model {self.name}: {type(exc).__name__}: {exc}") from exc
        finally:
            made.close()

    def _drive(self, agen: Any) -> Iterator[Any]:
        """An async generator stepped on this worker thread's own loop."""
        loop = self._loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(agen.aclose())

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        if self.decoupled:
            raise InvalidInput(
                f"model {self.name} is decoupled (it answers a request with any number of "
                "responses): call it over a gRPC stream or over HTTP with "
                "'Accept: text/event-stream'"
            )
        try:
            return self._run(inputs)
        except ServekitError:
            raise
        except Exception as exc:
            raise RunnerError(f"model {self.name}: {type(exc).__name__}: {exc}") from exc

    def end_sequence(self, sequence_id: int | str, reason: str) -> None:
        if isinstance(self.model, Model):
            self.model.end_sequence(sequence_id, reason)

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        """The model's own ``warmup`` where it has one, else one sample batch."""
        if isinstance(self.model, Model) and type(self.model).warmup is not Model.warmup:
            self.model.warmup()
        elif self.decoupled:
            for _ in self.responses(self.spec.sample_inputs(1)):
                pass
        else:
            super().warmup(batch_sizes)

    def close(self) -> None:
        if isinstance(self.model, Model):
            self.model.close()
        for loop in self._loops:  # the workers are done with them by now
            loop.close()
        self._loops.clear()


def import_model(
    source: str, *, name: str = "", path: str | None = None, args: Mapping[str, Any] | None = None
) -> Runner:
    """The model ``source`` (``module:attribute``) names, ready to serve: a ``Model``
    subclass constructed and ``setup(**args)``, an ``infer_function``, or any ``Runner``
    class constructed with ``args`` as keyword arguments. ``path`` goes first on
    ``sys.path`` (in this process: each process that serves it imports it itself).

    Raises:
        SetupFailed: its set-up raised, naming it (with the signature a ``Model`` declares).
        ValueError: it does not import, or is none of these; naming it.
    """
    label = name or source
    if path is not None and path not in sys.path:
        sys.path.insert(0, path)
    module_name, _, attribute = source.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except Exception as exc:
        where = f" (path {path})" if path else ""
        raise ValueError(
            f"model {label}: cannot import {source!r}{where}: {type(exc).__name__}: {exc}"
        ) from None
    args = dict(args or {})
    if callable(target) and not inspect.isclass(target) and args:
        raise ValueError(f"model {label}: {source} is a function: it takes no [models.args]")
    if not callable(target):
        raise ValueError(f"model {label}: {source} is not a class or a function")
    try:
        runner: object
        if inspect.isclass(target) and issubclass(target, Model):
            runner = UserRunner(_set_up(target, args), label)
        elif inspect.isclass(target):
            runner = target(**args)
        else:
            runner = UserRunner(target, label)
    except Exception as exc:
        raise SetupFailed(
            f"model {label}: {source} failed to set up: {type(exc).__name__}: {exc}",
            _declared(target),
        ) from None
    if not isinstance(runner, Runner):
        raise ValueError(
            f"model {label}: {source} is neither a servekit.Model subclass, an "
            "@infer_function nor a Runner (spec, infer, warmup, close)"
        )
    return runner


def _declared(target: Any) -> ModelSpec | None:
    """The signature a ``Model`` subclass declares (None if it declares none: a Runner's
    is known only once it is built)."""
    if not (inspect.isclass(target) and issubclass(target, Model)):
        return None
    if not target.inputs or not target.outputs or target.decoupled:
        return None
    return ModelSpec(
        _tensors(target.inputs, target), _tensors(target.outputs, target),
        int(target.max_batch_size),
    )  # fmt: skip


def _set_up(cls: type[Model], args: Mapping[str, Any]) -> Model:
    model = cls()
    model.setup(**args)
    return model
