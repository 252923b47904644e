"""Stages are Runners: the same contract (spec, infer, warmup, close) as engines.

So a stage can be batched, served on its own by every runtime, or chained in a
``Pipeline`` or a Triton ensemble, exactly like a model.
"""

from ..runners.base import BaseRunner as Stage

__all__ = ["Stage"]
