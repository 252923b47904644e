"""Rollout safety: several versions of one model, a weighted (or sticky) traffic split,
shadow runs compared with the answers returned, and a canary the server itself promotes
or rolls back from what it measures. The same ``Traffic`` decides on every runtime."""

from .compare import same_answer
from .judge import Verdict, Window, judge
from .policy import CanaryPolicy, ModelVersion, TrafficPolicy, parse_split
from .traffic import Traffic

__all__ = [
    "CanaryPolicy",
    "ModelVersion",
    "Traffic",
    "TrafficPolicy",
    "Verdict",
    "Window",
    "judge",
    "parse_split",
    "same_answer",
]
