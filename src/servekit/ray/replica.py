"""A model replica of the Ray app: a Runner (or an image stage) behind servekit's Batcher,
called by the ingress with a whole batch; its autoscaling signal and, for the ingress's
traced requests, spans of its own work continuing their traces (``servekit.tracing``)."""

from __future__ import annotations

import logging
import os
from typing import Any, TypeVar

from .. import tracing
from ..autoscale import AutoscalePolicy
from ..batching import Batcher, BatchingPolicy
from ..errors import DeviceLost, ServekitError
from ..metrics import Metrics
from ..spec import ModelSpec
from ..tracing import Tracing
from .autoscale import SIGNAL

__all__ = ["Batched"]

_T = TypeVar("_T")
log = logging.getLogger(__name__)


class Batched:
    """A Runner behind a Batcher inside one replica; errors travel back as themselves."""

    def __init__(
        self,
        runner: Any,
        policy: BatchingPolicy,
        name: str,
        autoscale: AutoscalePolicy | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.runner, self.name, self.tracing = runner, name, tracing
        self.batcher = Batcher(runner, policy, name=name)
        self.metrics = Metrics()  # the autoscaling signal's source, as every server's
        self.metrics.autoscale = {name: autoscale or AutoscalePolicy()}
        self.metrics.watch(self.batcher, name)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads (``servekit.ray.autoscale``)."""
        return {SIGNAL: self.metrics.replicas_needed(self.name)}

    async def __call__(
        self, inputs: dict[str, Any] | ServekitError, trace: tuple[str, ...] = ()
    ) -> dict[str, Any] | ServekitError:
        """One batch from the ingress; ``trace``: the traceparents of its traced requests,
        each continued here by a span of this replica's work (its queue, batch, steps)."""
        if isinstance(inputs, ServekitError):  # an earlier stage's error passes through
            return inputs
        if trace and self.tracing is not None:
            return self._alive(await self._traced(inputs, trace, self.tracing))
        try:
            return await self.batcher.infer(inputs)
        except DeviceLost:
            self._alive(None)
            raise
        except ServekitError as exc:
            return exc  # returned, not raised: Ray would wrap it and lose its type

    def _alive(self, answer: _T) -> _T:
        """``answer``, unless this replica's device was lost to a sticky CUDA error: then
        the replica exits with the batch unanswered, Ray starts a new one, and the ingress
        sends the batch again (``servekit.recovery``)."""
        if self.batcher.device_lost:
            log.error("%s: %s; this replica exits for Ray to replace", self.name,
                      self.batcher.device_lost)  # fmt: skip
            os._exit(70)
        return answer

    def broken(self) -> str | None:
        """Why this replica's model cannot serve (``runners.broken``); None while it can."""
        return self.batcher.broken

    async def _traced(
        self, inputs: dict[str, Any], trace: tuple[str, ...], tracer: Tracing
    ) -> dict[str, Any] | ServekitError:
        import ray

        replica = ray.get_runtime_context().get_actor_id()
        spans = [tracer.continued(f"replica {self.name}", p, replica=replica) for p in trace]
        current = tracing.CURRENT.set((spans[0], tracer.tracer))
        siblings = tracing.SIBLINGS.set(tuple(spans[1:]))
        error: ServekitError | None = None
        try:
            return await self.batcher.infer(inputs)
        except ServekitError as exc:
            error = exc
            return exc
        finally:
            tracing.SIBLINGS.reset(siblings)
            tracing.CURRENT.reset(current)
            for span in spans:
                tracing.finish(span, error)

    def spec(self) -> ModelSpec:
        return self.runner.spec

    def settings(self) -> dict[str, Any]:
        """What this replica runs with, read back: the Batcher's policy, the runner's threads."""
        runner = getattr(self.runner, "runner", self.runner)
        return {"policy": self.batcher.policy, "threads": getattr(runner, "threads", None)}

    async def where(self) -> dict[str, Any]:
        """This replica's node and counts: which replica did the work, how much, and how
        long the ingress's batches waited here for the device (``queue_us``, in all, over
        ``requests``: one per ingress batch)."""
        import ray

        s = self.batcher.stats
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "replica": ray.get_runtime_context().get_actor_id(),
            "executions": s.execution_count,
            "inferences": s.inference_count,
            "requests": s.request_success,
            "queue_us": s.queue_us,
        }
