"""Triton's schedulers: dynamic batching (policy, queue policy, decision, ``Batcher``) and
the sequence batcher (``SequencePolicy``, ``SequenceBatcher``)."""

from .batcher import Batcher
from .decision import Decision, decide
from .policy import BatchingPolicy, QueuePolicy, TimeoutAction
from .sequence import Controls, SequenceFlags, SequencePolicy, StateSpec
from .sequencer import SequenceBatcher
from .stats import BatcherStats, BatchRecord

__all__ = [
    "BatchRecord",
    "Batcher",
    "BatcherStats",
    "BatchingPolicy",
    "Controls",
    "Decision",
    "QueuePolicy",
    "SequenceBatcher",
    "SequenceFlags",
    "SequencePolicy",
    "StateSpec",
    "TimeoutAction",
    "decide",
]
