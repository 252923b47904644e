"""Your decoupled model inside tritonserver (``model_transaction_policy { decoupled: true }``):
each request's responses go out through its response sender as the model yields them,
then Triton's final flag alone; an error ends the request with it. A request whose client
left (tritonserver's cancellation, 24.10 on) stops the model at its next ``yield``.

Counts, on Triton's own metrics endpoint through the Python backend's custom metrics, the
same ``servekit_decoupled_*_total`` families the native and ray runtimes export.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..batching.execute import as_error
from ..errors import ServekitError, triton_code, worded
from ..protocol.models import DECOUPLED_METRICS
from ..runners.base import Runner

__all__ = ["DecoupledStreams"]


class DecoupledStreams:
    """Answers a decoupled model's requests (``execute`` in decoupled mode)."""

    def __init__(self, pb_utils: Any, runner: Runner, name: str, outputs: Sequence[str]) -> None:
        self._pb, self.runner, self.name, self.outputs = pb_utils, runner, name, tuple(outputs)
        self._families: list[Any] = []  # a family must outlive its metrics
        self._counts: dict[str, Any] = {}
        for key, (family, about) in DECOUPLED_METRICS.items():
            try:
                kind = pb_utils.MetricFamily.COUNTER
                self._families.append(pb_utils.MetricFamily(family, about, kind))
                self._counts[key] = self._families[-1].Metric(labels={"model": name})
            except Exception:  # metrics off in this tritonserver
                pass

    def _count(self, key: str) -> None:
        metric = self._counts.get(key)
        if metric is not None:
            metric.increment(1)

    def answer(self, request: Any, inputs: dict[str, np.ndarray]) -> None:
        """One request, answered to its end through its response sender."""
        pb = self._pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._count("requests")
        made = self.runner.responses(inputs)  # type: ignore[attr-defined]
        try:
            for outputs in made:
                self._count("responses")
                if sender.is_cancelled():
                    self._count("abandoned")
                    break
                tensors = [pb.Tensor(n, np.ascontiguousarray(outputs[n])) for n in self.outputs]
                sender.send(pb.InferenceResponse(output_tensors=tensors))
        except Exception as exc:
            error = exc if isinstance(exc, ServekitError) else as_error(exc, self.name)
            code = getattr(pb.TritonError, triton_code(error), pb.TritonError.INTERNAL)
            response = pb.InferenceResponse(error=pb.TritonError(worded(error, self.name), code))
            sender.send(response, flags=final)
            return
        finally:
            made.close()
        sender.send(flags=final)
