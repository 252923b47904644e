"""A model served in several versions behind one name: each request goes to the version
its model's ``Traffic`` chooses (or the one it names), a copy may run on the shadow
version, and every outcome goes back to ``Traffic`` for the canary's verdict.

The front (HTTP and gRPC, every runtime) calls ``infer_routed`` and puts the version that
answered in the response's ``model_version``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import numpy as np

from .. import tracing
from ..batching import Batcher
from ..batching.sequence import SequenceFlags
from ..batching.sequencer import SequenceBatcher
from ..config import ModelConfig, ServeConfig
from ..errors import InvalidInput
from ..rollout import Traffic, TrafficPolicy, same_answer
from ..spec import ModelSpec
from .models import FrontModel, SequencedModel, VersionTarget, as_front_model
from .parameters import unsequenced

__all__ = ["RoutedModel", "follow_file", "infer_answered", "route", "traffic_of"]

log = logging.getLogger(__name__)

SHADOWS_IN_FLIGHT = 32
"""Shadow copies running at once per model; one more is dropped (and counted), never queued."""

SERVING_SINCE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "serving_since", default=None
)
"""When a version began to serve the request in hand (``time.perf_counter``), set by a
version that may first wait to be loaded (a store's): the canary judges how a version
serves, so its latency counts from then, not the wait for memory."""


class RoutedModel:
    """Versions of one model (``by_version``: version -> FrontModel, same signature) behind
    ``traffic``."""

    versioned = True

    def __init__(
        self,
        versions: Mapping[int, FrontModel],
        traffic: Traffic,
        *,
        max_shadows: int = SHADOWS_IN_FLIGHT,
    ) -> None:
        self.by_version, self.traffic = dict(versions), traffic
        self.versions = tuple(str(v) for v in sorted(self.by_version))
        first = self.by_version[min(self.by_version)]
        self.spec: ModelSpec = first.spec
        self.batcher: Batcher | SequenceBatcher | None = first.batcher
        self.max_shadows = max_shadows
        self._shadows: set[asyncio.Task[None]] = set()

    @property
    def passes_through(self) -> bool:
        """Whether a request can go on as bytes (``forward_routed``): every version is
        answered by another server under the routed name, and no shadow needs the answer."""
        return self.traffic.shadow is None and all(
            isinstance(m, VersionTarget) and m.pass_through() is not None
            for m in self.by_version.values()
        )

    async def forward_routed(
        self,
        body: bytes,
        header_length: int | None,
        version: str,
        sticky: str | None,
        timeout_us: int | None = None,
    ) -> tuple[tuple[int, bytes, dict[str, str]], str]:
        """A checked request's bytes to the version the split chooses (``passes_through``):
        the other server's answer as it is, and the version; the canary sees its outcome."""
        traffic = self.traffic
        chosen = traffic.route(version, sticky)
        target = cast(VersionTarget, self.by_version[chosen]).pass_through()
        assert target is not None, "forward_routed needs passes_through"
        model, target_version = target
        start = time.perf_counter()
        try:
            status, payload, headers = await model.forward(
                body, header_length, target_version, timeout_us
            )
        except Exception:
            traffic.record(chosen, time.perf_counter() - start, False)
            raise
        if status != 400:  # a 400 is the request's fault, not the version's
            traffic.record(chosen, time.perf_counter() - start, status == 200)
        return (status, payload, headers), str(chosen)

    def batchers(self) -> dict[str, Batcher | SequenceBatcher]:
        """Each version's Batcher, by version (for metrics)."""
        return {str(v): m.batcher for v, m in self.by_version.items() if m.batcher is not None}

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        outputs, _ = await self.infer_routed(
            inputs, priority=priority, timeout_us=timeout_us, version=version
        )
        return outputs

    async def infer_routed(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
        sticky: str | None = None,
    ) -> tuple[dict[str, np.ndarray], str]:
        """The answer and the version that gave it."""
        traffic = self.traffic
        chosen = traffic.route(version, sticky)
        began = time.monotonic()
        outputs, ok, took = await self._timed(self.by_version[chosen], inputs, priority, timeout_us)
        traffic.record(chosen, took, ok)
        tracing.child("version", began, time.monotonic(), version=chosen,
                      canary=chosen == traffic.canary, ok=ok)  # fmt: skip
        if not ok:
            raise cast(BaseException, outputs)
        shadow = traffic.shadow_of(chosen)
        if shadow is not None:
            self._start_shadow(shadow, inputs, outputs)
        return outputs, str(chosen)

    @staticmethod
    async def _timed(
        model: FrontModel, inputs: Mapping[str, np.ndarray], priority: int, timeout_us: int | None
    ) -> tuple[Any, bool, float]:
        """(outputs or the error, whether it answered, seconds it took to serve, from
        ``SERVING_SINCE`` where the version set it); ``InvalidInput`` is the request's
        fault, not the version's, and raised at once."""
        token = SERVING_SINCE.set(None)
        start = time.perf_counter()
        try:
            outputs: Any = await model.infer(inputs, priority=priority, timeout_us=timeout_us)
            ok = True
        except InvalidInput:
            raise
        except Exception as exc:
            outputs, ok = exc, False
        finally:
            since = SERVING_SINCE.get()
            SERVING_SINCE.reset(token)
        return outputs, ok, time.perf_counter() - (since or start)

    def _start_shadow(
        self, version: int, inputs: Mapping[str, np.ndarray], answer: Mapping[str, np.ndarray]
    ) -> None:
        if len(self._shadows) >= self.max_shadows:
            self.traffic.dropped(version)
            return
        task = asyncio.get_running_loop().create_task(self._shadow(version, inputs, answer))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(
        self, version: int, inputs: Mapping[str, np.ndarray], answer: Mapping[str, np.ndarray]
    ) -> None:
        """Run the copy, compare, record; whatever happens, the client has its answer already
        (the request's trace, where it has one, gets a ``shadow`` span after it ended)."""
        start, began = time.perf_counter(), time.monotonic()
        try:
            outputs, ok, took = await self._timed(self.by_version[version], inputs, 0, None)
        except InvalidInput as exc:  # the answer's version took it: the shadow's own fault
            outputs, ok, took = exc, False, time.perf_counter() - start
        self.traffic.record(version, took, ok, shadow=True)
        if not ok:
            tracing.child("shadow", began, time.monotonic(), version=version, ok=False)
            log.debug(
                "%s: shadow run on version %d failed: %s", self.traffic.name, version, outputs
            )
            return
        same = same_answer(answer, outputs)
        tracing.child("shadow", began, time.monotonic(), version=version, ok=True, same=same)
        self.traffic.compared(version, same)


async def infer_answered(
    model: FrontModel,
    inputs: Mapping[str, np.ndarray],
    *,
    priority: int = 0,
    timeout_us: int | None = None,
    version: str = "",
    sticky_of: Callable[[str], str | None] = lambda _: None,
    sequence: SequenceFlags | None = None,
    name: str = "",
) -> tuple[dict[str, np.ndarray], str]:
    """Any front model's answer and the version that gave it (HTTP and gRPC both ask here);
    ``sticky_of`` reads a request header (HTTP) or metadata key (gRPC) by name;
    ``sequence``: the request's sequence, for a model with a sequence batcher (a sequence
    id sent to any other is refused, naming the model)."""
    if isinstance(model, SequencedModel):
        return await model.infer_in_sequence(inputs, sequence), "1"
    if sequence is not None:
        raise unsequenced(name, sequence)
    if isinstance(model, RoutedModel):
        header = model.traffic.sticky
        return await model.infer_routed(
            inputs,
            priority=priority,
            timeout_us=timeout_us,
            version=version,
            sticky=sticky_of(header) if header else None,
        )
    outputs = await model.infer(inputs, priority=priority, timeout_us=timeout_us, version=version)
    return outputs, version or (model.versions[-1] if model.versions else "1")


def traffic_of(models: Iterable[ModelConfig]) -> dict[str, Traffic]:
    """A ``Traffic`` for each model served in several versions or with a traffic table."""
    return {
        m.name: Traffic(
            m.name, m.version_numbers, m.traffic or TrafficPolicy({m.version: 100}), m.canary
        )
        for m in models
        if m.versions or m.traffic
    }


def follow_file(traffic: Mapping[str, Traffic], config: ServeConfig) -> list[str]:
    """Each model's split as ``config`` (the file, read again) now gives it
    (``Traffic.follow_file``); one line per split changed."""
    lines = []
    for m in config.models:
        if m.name in traffic and m.traffic is not None:
            line = traffic[m.name].follow_file(m.traffic)
            if line is not None:
                lines.append(line)
    return lines


def route(
    versions: Mapping[str, Mapping[int, Any]], traffic: Mapping[str, Traffic]
) -> dict[str, Any]:
    """What a front serves: ``name -> {version: model}`` (Batchers, Runners or front
    models) as one ``RoutedModel`` per name that has a ``Traffic``, else the one model."""
    served: dict[str, Any] = {}
    for name, by_version in versions.items():
        if name in traffic:
            models = {v: as_front_model(m) for v, m in by_version.items()}
            served[name] = RoutedModel(models, traffic[name])
        else:
            (served[name],) = by_version.values()
    return served
