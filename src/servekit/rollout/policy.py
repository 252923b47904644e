"""Rollout configuration: the versions of one model, how traffic splits between them, and
the canary the server judges. Frozen dataclasses, checked when made, the same on every
runtime (``[[models.versions]]``, ``[models.traffic]``, ``[models.canary]``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..tables import check_keys

__all__ = ["CanaryPolicy", "ModelVersion", "TrafficPolicy", "parse_split"]

ON_FAILURE = ("rollback", "hold")


@dataclass(frozen=True)
class ModelVersion:
    """A version of a model beside its own (``source``, version 1 but in a store)."""

    version: int
    source: str

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ValueError(
                f"[[models.versions]]: version must be an integer >= 1 (other than the "
                f"model's own), got {self.version!r}"
            )
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(
                f"[[models.versions]] {self.version}: source must be a path or a zoo name"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "models.versions") -> ModelVersion:
        check_keys(section, data, {"version", "source"}, cls)
        return cls(**data)


def parse_split(split: Mapping[Any, Any], section: str = "models.traffic") -> dict[int, int]:
    """``{version: percent}`` from a table whose keys may be strings (TOML, JSON); the
    percentages are whole numbers from 0 to 100 that sum to 100."""
    if not isinstance(split, Mapping) or not split:
        raise ValueError(f"[{section}] split: expected a table of version = percent, got {split!r}")
    out: dict[int, int] = {}
    for key, weight in split.items():
        try:
            version = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"[{section}] split: versions are integers, got {key!r}") from None
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
            raise ValueError(
                f"[{section}] split: version {version}'s share must be a whole percent "
                f"from 0 to 100, got {weight!r}"
            )
        out[version] = weight
    total = sum(out.values())
    if total != 100:
        raise ValueError(f"[{section}] split: shares must sum to 100, got {total} ({out})")
    return out


@dataclass(frozen=True)
class TrafficPolicy:
    """How requests that name no version are spread over the versions."""

    split: Mapping[int, int] = field(default_factory=lambda: {1: 100})
    """version -> percent of the requests; the percentages sum to 100."""
    sticky: str | None = None
    """A request header: requests with the same value always get the same version (absent:
    the weights decide, as for any request)."""
    shadow: int | None = None
    """A version that also runs a copy of each request; its answer is compared with the
    one returned, never returned itself."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", parse_split(self.split))
        if self.sticky is not None and (not isinstance(self.sticky, str) or not self.sticky):
            raise ValueError(f"[models.traffic] sticky: a header name, got {self.sticky!r}")
        if self.sticky:
            object.__setattr__(self, "sticky", self.sticky.lower())

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"split": {str(v): w for v, w in self.split.items()}}
        if self.sticky:
            data["sticky"] = self.sticky
        if self.shadow is not None:
            data["shadow"] = self.shadow
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "models.traffic") -> TrafficPolicy:
        check_keys(section, data, {"split", "sticky", "shadow"}, cls)
        return cls(**data)


@dataclass(frozen=True)
class CanaryPolicy:
    """The server's own verdict on the version with the smallest share (the canary)
    against the one with the largest (the baseline), window by window."""

    min_requests: int = 200
    """Requests per version in a window before any verdict."""
    max_error_rate: float = 0.01
    """The canary's failed share of its requests, absolute: above it, and more than the
    baseline's beyond chance (``confidence``), the canary fails."""
    max_p99_ratio: float = 1.5
    """The canary's p99 latency over the baseline's, in the same window: above it, by more
    than ``max_p99_increase_ms``, and slower beyond chance, the canary fails."""
    max_p99_increase_ms: float = 1.0
    """The least p99 increase that can fail a canary: differences of sub-millisecond
    latencies are noise, whatever their ratio (Flagger's and Argo's absolute limits)."""
    confidence: float = 0.999
    """How sure a verdict must be that the canary is worse than the baseline, given both
    windows' sizes (Mann-Whitney U and a tail test for latency, Fisher's exact test
    for errors; Kayenta's way): 1 - the false-failure rate of each comparison. A canary
    is judged two or three times on its way to 100 %, so 0.999 keeps a same-speed
    version's false rollbacks near one in 500; a slower one gives p-values far smaller."""
    max_mismatch_rate: float = 0.0
    """The share of the canary's shadow answers that differ from the baseline's."""
    step: tuple[int, ...] = (10, 50, 100)
    """The canary's share after each passed window; 100 = promoted."""
    on_failure: str = "rollback"
    """``rollback``: all traffic back to the baseline; ``hold``: keep the split, stop judging."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "step", tuple(self.step))
        if self.min_requests < 1:
            raise ValueError(f"[models.canary] min_requests must be >= 1, got {self.min_requests}")
        for key in ("max_error_rate", "max_mismatch_rate"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"[models.canary] {key} must be in [0, 1], got {value}")
        if self.max_p99_ratio <= 0:
            raise ValueError(f"[models.canary] max_p99_ratio must be > 0, got {self.max_p99_ratio}")
        if not self.max_p99_increase_ms >= 0:
            raise ValueError(
                f"[models.canary] max_p99_increase_ms must be >= 0, got {self.max_p99_increase_ms}"
            )
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(
                f"[models.canary] confidence must be in [0.5, 1), got {self.confidence}"
            )
        steps = self.step
        if (
            not steps
            or any(isinstance(s, bool) or not isinstance(s, int) for s in steps)
            or list(steps) != sorted(set(steps))
            or not steps[0] > 0
            or steps[-1] != 100
        ):
            raise ValueError(
                f"[models.canary] step must be increasing whole percents ending at 100, got {list(steps)}"
            )
        if self.on_failure not in ON_FAILURE:
            raise ValueError(
                f"[models.canary] on_failure must be one of {list(ON_FAILURE)}, got {self.on_failure!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["step"] = list(self.step)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "models.canary") -> CanaryPolicy:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        return cls(**data)
