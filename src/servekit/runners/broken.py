"""A model none of whose instances can serve, and how a runner says so.

A model whose set-up raised (``SetupFailed``) is served as ``Unready``: its declared
signature, every batch refused with the set-up's words, and ``broken`` saying why, which
readiness and the repository index read on every runtime (``docs/operations.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import ModelBroken
from ..spec import ModelSpec
from .base import Arrays, BaseRunner

__all__ = ["Breakable", "Unready", "broken"]


@runtime_checkable
class Breakable(Protocol):
    """A runner (or batcher) that knows when it can no longer serve."""

    @property
    def broken(self) -> str | None:
        """Why no instance can serve (``setup failed: ...``, ``device lost: ...``); None
        while it can."""
        ...


class Unready(BaseRunner):
    """Stands in for a model whose set-up failed: its declared signature, not ready with
    ``reason``, every batch refused with ``ModelBroken``."""

    def __init__(self, spec: ModelSpec, reason: str) -> None:
        self._spec, self._reason = spec, reason

    @property
    def broken(self) -> str:
        return self._reason

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        raise ModelBroken(self._reason)

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        """Nothing to warm: the model never set up."""


def broken(thing: object) -> str | None:
    """Why ``thing`` (a runner, a batcher) cannot serve; None where it can or cannot say."""
    return thing.broken if isinstance(thing, Breakable) else None
