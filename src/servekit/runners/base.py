"""The Runner contract: a model (or stage) that maps a dict of batched arrays to a dict of arrays.

Everything servekit serves is a Runner: ONNX Runtime and TensorRT engines, image
stages, a ``Pipeline`` of them, or any Python function wrapped in ``FunctionRunner``.
The batcher and every runtime wrapper speak only this contract.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import InvalidInput, RunnerError, ServekitError
from ..spec import ModelSpec
from .staging import Lends, StagingPool

__all__ = [
    "BaseRunner",
    "FunctionRunner",
    "Lender",
    "Runner",
    "batch_function",
    "staging_of",
    "tensor_device",
    "warm_up",
    "warm_up_skipped",
]

Arrays = dict[str, np.ndarray]

log = logging.getLogger(__name__)


@runtime_checkable
class Runner(Protocol):
    """What every servable model provides."""

    @property
    def spec(self) -> ModelSpec: ...

    def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Run one batch; inputs and outputs carry the batch dim first when ``spec.batched``."""
        ...

    def warmup(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Lender(Protocol):
    """A runner that lends the batcher its input buffers (``runners.staging``)."""

    @property
    def staging(self) -> Lends: ...


class BaseRunner:
    """Shared behaviour: validation around ``_run``, sample-input warm-up, context manager.

    Subclasses set ``self._spec`` and implement ``_run``; ``infer`` validates inputs
    (raising ``InvalidInput``) and, with ``check_outputs``, the outputs (``RunnerError``).
    """

    _spec: ModelSpec
    check_outputs: bool = True
    accelerated: bool = False
    """Whether a batch runs off the host's CPU (a GPU, a simulated device): then its run
    time leaves the cores free for handing over the next batch (``ModelConfig.overlap``)."""

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @cached_property
    def staging(self) -> StagingPool:
        """The buffers batches are assembled in: reused plain host arrays here; a CUDA
        runner lends pinned memory."""
        return StagingPool(self._spec.max_batch_size)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        rows = self._spec.validate_inputs(inputs)
        outputs = self.run(inputs)
        if self.check_outputs:
            self._spec.check_outputs(outputs, rows)
        return outputs

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """A batch whose requests were validated already (by a batcher, which also checks
        the outputs): no second check; an engine failure becomes a ``RunnerError``."""
        try:
            return self._run(inputs)
        except ServekitError:
            raise
        except Exception as exc:  # an engine failure is the model's, not the caller's
            raise RunnerError(f"{type(self).__name__}: {type(exc).__name__}: {exc}") from exc

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        raise NotImplementedError

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        """Run sample inputs once per batch size so first requests do not pay for lazy init.

        A model that refuses them (``InvalidInput``: its own validation) is not warmed up,
        said in one log line; anything else it raises is raised (a new version's update
        refuses it), and ``warm_up``, which every runtime starts a model with, logs that
        too and starts it. Override ``warmup_inputs`` to give inputs it accepts (Triton's
        ``model_warmup``)."""
        sizes = batch_sizes if self._spec.batched else (1,)
        for n in sizes:
            try:
                self.infer(self.warmup_inputs(min(n, max(self._spec.max_batch_size, 1))))
            except InvalidInput as exc:
                warm_up_skipped(type(self).__name__, exc)
                return

    def warmup_inputs(self, rows: int) -> dict[str, np.ndarray]:
        """The inputs warm-up runs, ``rows`` rows (1 where the model does not batch): random
        samples of the signature by default."""
        return self._spec.sample_inputs(rows)

    def close(self) -> None:
        """Release engine resources; the default has none."""

    def __enter__(self) -> BaseRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FunctionRunner(BaseRunner):
    """A Runner around a plain function of ``dict[str, ndarray] -> dict[str, ndarray]``.

    Lets the batcher and every wrapper be tested and used without an engine.
    """

    def __init__(
        self,
        fn: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
        spec: ModelSpec,
        *,
        check_outputs: bool = True,
    ) -> None:
        self._fn = fn
        self._spec = spec
        self.check_outputs = check_outputs

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return dict(self._fn(inputs))


def warm_up(runner: Runner, name: str = "") -> Exception | None:
    """Warm ``runner`` up to start it: what it raises, whatever it is, is logged in one
    line and returned, never raised, for warm-up never stops a start (the model serves
    cold, and answers each request as its inputs deserve).

    Args:
        runner: the model about to serve.
        name: the model's, for the log (the runner's type when empty).

    Returns:
        The exception warm-up raised; None when it ran.
    """
    try:
        runner.warmup()
    except Exception as exc:
        warm_up_skipped(name or type(runner).__name__, exc)
        return exc
    return None


def warm_up_skipped(label: str, exc: BaseException) -> None:
    """The one log line of a warm-up that raised: the model, the exception (the model's
    own, not servekit's wrapping) and how to give warm-up inputs the model accepts."""
    root = exc
    while isinstance(root, ServekitError) and root.__cause__ is not None:
        root = root.__cause__
    log.warning(
        "%s: warm-up skipped, the model starts without it: its sample inputs raised %s: %s; "
        "give warm-up inputs it accepts with warmup_inputs(rows) (a Runner) or its own "
        "warmup() (a servekit.Model)", label, type(root).__name__, root,
    )  # fmt: skip


def batch_function(
    runner: Runner,
) -> Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]:
    """What a batcher calls for a batch it validated request by request: the runner's
    ``run`` where it has one (``BaseRunner``, ``VersionedRunner``: no second validation;
    the batcher checks the outputs once), any other Runner's ``infer``."""
    run = getattr(runner, "run", None)
    return run if callable(run) else runner.infer


def staging_of(runner: object, spec: ModelSpec) -> Lends:
    """The staging a batch for ``runner`` is assembled in: the runner's own where it lends
    one (a ``Lender``), else a new pool of plain reused arrays for the caller to keep."""
    if isinstance(runner, Lender):
        return runner.staging
    return StagingPool(spec.max_batch_size)


def tensor_device(runner: object) -> Any:
    """The torch device whose tensors ``runner`` takes as inputs as they are
    (``TorchRunner.tensor_device``); None where it takes host arrays."""
    return getattr(runner, "tensor_device", None)


def accelerated(runner: object) -> bool:
    """``runner.accelerated``: whether its batches run off the host's CPU (False when it
    does not say)."""
    return bool(getattr(runner, "accelerated", False))


def overlaps(overlap: bool | None, runner: object) -> bool:
    """``ModelConfig.overlap`` resolved for ``runner``: as set, or (None) where the runner
    is ``accelerated``. The one rule, for every runtime that overlaps."""
    return overlap if overlap is not None else accelerated(runner)
