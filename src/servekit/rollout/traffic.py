"""One model's traffic across its versions: which version answers each request, the
shadow beside it, and the canary's windows and verdicts.

Every runtime asks the same ``Traffic`` (through ``protocol.routed.RoutedModel``), so a
split means the same on each. A split changes only what the next request gets: a request
already running finishes on its version, so a promotion or a rollback fails nothing and
never mixes versions inside one answer. Thread-safe.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import InvalidInput, ModelNotFound
from .judge import Window, judge
from .policy import CanaryPolicy, TrafficPolicy, parse_split

__all__ = ["Traffic"]

log = logging.getLogger(__name__)

EVENTS_KEPT = 50


class Traffic:
    """The split, the sticky routing, the shadow and the canary of one model.

    Args:
        name: the model's served name (in events and errors).
        versions: the versions loaded.
        policy: the split, sticky header and shadow version.
        canary: judge the version with the smallest share against the largest, if set.
        rng: uniform numbers in [0, 1) for the weighted choice (injectable for tests).
    """

    def __init__(
        self,
        name: str,
        versions: Iterable[int],
        policy: TrafficPolicy,
        canary: CanaryPolicy | None = None,
        *,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name, self.versions = name, tuple(sorted(versions))
        self.sticky, self.canary_policy = policy.sticky, canary
        self._rng, self._clock = rng, clock
        self._lock = threading.Lock()
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)
        self.counts: dict[int, dict[str, int]] = {
            v: {"requests": 0, "errors": 0, "shadow_runs": 0, "compared": 0, "mismatches": 0,
                "shadow_dropped": 0}
            for v in self.versions
        }  # fmt: skip
        self.verdicts: collections.Counter[tuple[int, str]] = collections.Counter()
        self._split: dict[int, int] = {}
        self._cumulative: list[tuple[float, int]] = []
        self.shadow: int | None = None
        self._set_split(self._known(policy.split))
        self.file_split = dict(self._split)
        """The split the configuration file last gave (``follow_file``)."""
        if policy.shadow is not None:
            self._known({policy.shadow: 0})
            self.shadow = policy.shadow
        self.canary: int | None = None
        self.baseline: int | None = None
        self.state = "off"
        self._windows: dict[int, Window] = {}
        self.last_window: dict[str, Any] = {}
        if canary is not None:
            self._start_canary()
        self.on_change: Callable[[dict[str, Any]], None] | None = None
        """Told each change made here (a split, a shadow, a verdict) as ``shared()`` reads
        it, under this Traffic's lock: it must not block (the Ray ingress shares it)."""

    # ------------------------------------------------------------ routing

    @property
    def split(self) -> dict[int, int]:
        return dict(self._split)

    def choose(self, sticky_value: str | None = None) -> int:
        """The version for a request that names none: by its sticky header's value when
        it has one (always the same version for the same value and split), else at random
        with the split's weights."""
        if sticky_value is not None:
            digest = hashlib.blake2b(sticky_value.encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "big") % 10_000 / 100
        else:
            point = self._rng() * 100
        for bound, version in self._cumulative:
            if point < bound:
                return version
        return self._cumulative[-1][1]

    def version(self, named: str) -> int:
        """The version a request named (``/versions/<v>/``): it bypasses the split."""
        try:
            version = int(named)
        except ValueError:
            version = -1
        if version not in self.counts:
            raise ModelNotFound(
                f"model {self.name!r} has no version {named!r}; it has {list(self.versions)}"
            )
        return version

    def route(self, named: str, sticky_value: str | None = None) -> int:
        """The version that answers a request: the one it names, else the split's choice."""
        return self.version(named) if named else self.choose(sticky_value)

    def shadow_of(self, version: int) -> int | None:
        """The version that also runs a copy of a request answered by ``version``."""
        shadow = self.shadow
        return shadow if shadow is not None and shadow != version else None

    # ------------------------------------------------------------ outcomes

    def record(self, version: int, latency_s: float, ok: bool, *, shadow: bool = False) -> None:
        """A run of ``version``: an answer (or a shadow's run) and how long it took."""
        with self._lock:
            counts = self.counts[version]
            counts["shadow_runs" if shadow else "requests"] += 1
            if not ok:
                counts["errors"] += 1
            window = self._windows.get(version)
            if window is not None:
                window.add(latency_s, ok)
                self._judge()

    def compared(self, version: int, same: bool) -> None:
        """A shadow run of ``version`` answered like (``same``) the answer returned."""
        with self._lock:
            counts = self.counts[version]
            counts["compared"] += 1
            counts["mismatches"] += not same
            window = self._windows.get(version)
            if window is not None:
                window.compared += 1
                window.mismatches += not same
                self._judge()

    def dropped(self, version: int) -> None:
        """A shadow copy not run: the shadow queue was full."""
        with self._lock:
            self.counts[version]["shadow_dropped"] += 1

    # ------------------------------------------------------------ control

    def set_split(self, split: Mapping[Any, Any], *, why: str = "set by request") -> None:
        """A new split, live; the canary (if any) is judged afresh from it."""
        parsed = self._known(parse_split(split, "traffic"))
        with self._lock:
            self._set_split(parsed)
            if self.canary_policy is not None:
                self._start_canary()
            self._event("split", why, split=dict(self._split))

    def parse_shadow(self, shadow: Any) -> int | None:
        """A shadow version as a request names it (a number, or null for none), checked."""
        if shadow is None:
            return None
        try:
            number = int(shadow)
        except (TypeError, ValueError):
            raise InvalidInput(
                f"model {self.name!r}: shadow must be a version number or null, got {shadow!r}"
            ) from None
        self._known({number: 0})
        return number

    def set_shadow(self, shadow: int | None, *, why: str = "set by request") -> None:
        """A new shadow version (None: none), live; the canary (if any) is judged afresh."""
        shadow = self.parse_shadow(shadow)
        with self._lock:
            self.shadow = shadow
            if self.canary_policy is not None:
                self._start_canary()
            self._event("shadow", why, shadow=shadow)

    def follow_file(self, policy: TrafficPolicy) -> str | None:
        """The file's split, re-read (SIGHUP): applied, and the canary judged afresh, only
        when the file changed it, so a reload does not undo a verdict or a live split the
        file never mentioned. Returns what it did, or None."""
        split = self._known(policy.split)
        if split == self.file_split:
            return None
        self.set_split(split, why="the file's split, re-read")
        self.file_split = split
        return f"{self.name}: traffic split {split} from the file"

    def shared(self) -> dict[str, Any]:
        """What another copy of this Traffic needs to route as this one does (``adopt``)."""
        return {
            "split": {str(v): w for v, w in self._split.items()},
            "shadow": self.shadow,
            "state": self.state,
            "canary": self.canary,
            "baseline": self.baseline,
        }

    def adopt(
        self, shared: Mapping[str, Any], why: str, *, unless: Callable[[], bool] | None = None
    ) -> bool:
        """Another copy's change (``shared()`` there), applied here as it was made there: a
        canary still being judged starts a fresh window, a verdict given stays given. Not
        applied (False) when ``unless()`` holds, asked under the lock every change here
        takes: a change made here meanwhile, still to be shared, is the newer one."""
        with self._lock:
            if unless is not None and unless():
                return False
            self._set_split(self._known({int(v): int(w) for v, w in shared["split"].items()}))
            self.shadow = shared["shadow"]
            if shared["state"] == "judging" and self.canary_policy is not None:
                self._start_canary()
            else:
                self.state, self._windows = shared["state"], {}
                self.canary, self.baseline = shared["canary"], shared["baseline"]
            self._event("adopted", why, split=dict(self._split), tell=False)
            return True

    def state_dict(self) -> dict[str, Any]:
        """What ``GET /v2/models/<m>/traffic`` answers."""
        with self._lock:
            canary = None
            if self.canary_policy is not None:
                canary = {
                    "state": self.state,
                    "version": self.canary,
                    "baseline": self.baseline,
                    "policy": self.canary_policy.to_dict(),
                    "window": {str(v): w.figures() for v, w in self._windows.items()},
                    "last_window": self.last_window,
                }
            return {
                "model": self.name,
                "versions": list(self.versions),
                "split": {str(v): w for v, w in self._split.items()},
                "sticky": self.sticky,
                "shadow": self.shadow,
                "canary": canary,
                "counts": {str(v): dict(c) for v, c in self.counts.items()},
                "events": list(self.events),
            }

    # ------------------------------------------------------------ inside

    def _known(self, split: Mapping[int, int]) -> dict[int, int]:
        unknown = sorted(set(split) - set(self.versions))
        if unknown:
            raise InvalidInput(
                f"model {self.name!r}: unknown version(s) {unknown} in the traffic split; "
                f"it has {list(self.versions)}"
            )
        return dict(split)

    def _set_split(self, split: dict[int, int]) -> None:
        self._split = split
        bound, cumulative = 0.0, []
        for version in sorted(split):
            if split[version]:
                bound += split[version]
                cumulative.append((bound, version))
        self._cumulative = cumulative

    def _start_canary(self) -> None:
        """Judge the smallest share against the largest (holds the lock or is in __init__)."""
        candidates = {**({self.shadow: 0} if self.shadow is not None else {}), **self._split}
        shares = sorted(candidates.items(), key=lambda item: (item[1], -item[0]))
        if len(shares) < 2 or shares[0][1] == 100:
            self.state, self.canary, self.baseline, self._windows = "off", None, None, {}
            return
        self.canary, self.baseline = shares[0][0], shares[-1][0]
        self.state = "judging"
        self._windows = {self.canary: Window(), self.baseline: Window()}

    def _judge(self) -> None:
        policy, canary, baseline = self.canary_policy, self.canary, self.baseline
        if policy is None or canary is None or baseline is None or self.state != "judging":
            return
        windows = self._windows
        verdict = judge(windows[canary], windows[baseline], policy)
        if verdict.kind == "wait":
            return
        figures = {str(v): w.figures() for v, w in windows.items()}
        self.last_window = {"verdict": verdict.kind, "reasons": list(verdict.reasons), **figures}
        share = self._split.get(canary, 0)
        if verdict.kind == "pass":
            nxt = min(s for s in (*policy.step, 100) if s > share) if share < 100 else 100
            self._set_split({**{v: 0 for v in self._split}, canary: nxt, baseline: 100 - nxt})
            kind = "promoted" if nxt == 100 else "step"
            self.verdicts[(canary, kind)] += 1
            if nxt == 100:
                self.state, self._windows = "promoted", {}
            else:
                self._windows = {canary: Window(), baseline: Window()}
            self._event(kind, f"version {canary} passed a window: share {share} -> {nxt}",
                        split=dict(self._split), figures=figures)  # fmt: skip
            return
        self.verdicts[(canary, "fail")] += 1
        why = "; ".join(verdict.reasons)
        if policy.on_failure == "rollback":
            self._set_split({**{v: 0 for v in self._split}, baseline: 100})
            if self.shadow == canary:
                self.shadow = None
            self.state, self._windows = "rolled back", {}
            self._event("rollback", f"version {canary} failed: {why}",
                        split=dict(self._split), figures=figures)  # fmt: skip
        else:
            self.state, self._windows = "held", {}
            self._event("hold", f"version {canary} failed: {why}", split=dict(self._split),
                        figures=figures)  # fmt: skip

    def _event(self, kind: str, why: str, *, tell: bool = True, **details: Any) -> None:
        event = {"time": round(self._clock(), 3), "event": kind, "why": why, **details}
        self.events.append(event)
        log.warning("%s: %s: %s", self.name, kind, why)
        if tell and self.on_change is not None:
            self.on_change(self.shared())
