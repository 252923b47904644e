"""Dynamic batching with Triton's semantics: policy, queue policy, decision, Batcher."""

from .batcher import Batcher
from .decision import Decision, decide
from .policy import BatchingPolicy, QueuePolicy, TimeoutAction
from .stats import BatcherStats, BatchRecord

__all__ = [
    "BatchRecord",
    "Batcher",
    "BatcherStats",
    "BatchingPolicy",
    "Decision",
    "QueuePolicy",
    "TimeoutAction",
    "decide",
]
