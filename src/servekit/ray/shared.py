"""One traffic per model, and one set of trace settings, for every ingress replica of a
run, on every host.

Each ingress replica routes with its own ``Traffic`` (``servekit.rollout``), so without
this a split set through one host's proxy, or a canary's verdict reached in one replica,
would change that replica alone. Every change made in a replica (a split or a shadow set
by request, a verdict) is written to Ray's GCS key-value store under the run's id as a
new numbered entry (numbers taken with put-if-absent, so two replicas never take one),
and every replica applies the highest-numbered entry it has not applied yet: whichever
change was made last is the one every replica routes by. A change made here while
another's is being applied is the newer one (it is published after), so the other's is
skipped here. A replica that starts later (a host back, a replica replaced) applies the
newest before it has served for long. Trace settings (``servekit.tracing``) are shared
the same way: a change through Triton's trace extension on one replica is every
replica's (``trace_count`` counts per replica).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Mapping
from typing import Any

from ..rollout import Traffic
from ..tracing import Tracing
from .drain import NAMESPACE

__all__ = ["SharedTraffic"]

log = logging.getLogger(__name__)

POLL_S = 0.25


def _prefix(run_id: str, key: str) -> bytes:
    return f"{run_id}:{key}:".encode()


class SharedTraffic:
    """Shares ``traffic`` (name -> Traffic of this replica), and ``tracing``'s settings,
    with the run's other replicas. Each is shared through ``on_change`` (told what
    another copy needs, ``shared()``) and ``adopt`` (a change another copy made)."""

    def __init__(
        self,
        run_id: str,
        traffic: Mapping[str, Traffic],
        replica: str,
        poll_s: float = POLL_S,
        tracing: Tracing | None = None,
    ) -> None:
        self.run_id, self.replica, self.poll_s = run_id, replica, poll_s
        self.kept: dict[str, Traffic | Tracing] = {f"traffic:{n}": t for n, t in traffic.items()}
        if tracing is not None:
            self.kept["trace"] = tracing
        self.applied = {key: 0 for key in self.kept}
        """The number of the newest entry each one follows here (0: the file's)."""
        self._made: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._unshared = {key: 0 for key in self.kept}
        """Changes made here not yet published, each counted under its owner's lock."""
        self._count = threading.Lock()
        self._failing = False
        for key, t in self.kept.items():
            t.on_change = lambda shared, key=key: self._made_here(key, shared)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="servekit-traffic", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop sharing (a replica's thread otherwise ends with its process)."""
        self._closed.set()
        self._thread.join()

    def _made_here(self, key: str, shared: dict[str, Any]) -> None:
        with self._count:
            self._unshared[key] += 1
        self._made.put((key, shared))

    def _run(self) -> None:
        made: list[tuple[str, dict[str, Any]]] = []
        while not self._closed.is_set():
            try:
                made.append(self._made.get(timeout=self.poll_s))
                while True:  # every change made here goes out before any is followed
                    made.append(self._made.get_nowait())
            except queue.Empty:
                pass
            try:
                while made:
                    self._publish(*made[0])
                    with self._count:
                        self._unshared[made.pop(0)[0]] -= 1
                for key in self.kept:
                    self._follow(key)
            except Exception as exc:  # the GCS briefly unreachable: try again next turn
                if not self._failing:
                    log.warning(
                        "shared traffic and trace settings: cannot reach Ray's key-value store: %s",
                        exc,
                    )
                self._failing = True
            else:
                self._failing = False

    def _newest(self, key: str) -> int:
        from ray.experimental import internal_kv as kv

        prefix = _prefix(self.run_id, key)
        keys = kv._internal_kv_list(prefix, namespace=NAMESPACE)
        return max((int(k[len(prefix) :]) for k in keys), default=0)

    def _publish(self, key: str, shared: dict[str, Any]) -> None:
        from ray.experimental import internal_kv as kv

        value = json.dumps({"by": self.replica, "shared": shared}).encode()
        while True:
            number = self._newest(key) + 1
            entry = _prefix(self.run_id, key) + b"%010d" % number
            if not kv._internal_kv_put(entry, value, overwrite=False, namespace=NAMESPACE):
                self.applied[key] = number  # made here, so already applied here
                return

    def _follow(self, key: str) -> None:
        from ray.experimental import internal_kv as kv

        number = self._newest(key)
        if number <= self.applied[key]:
            return
        raw = kv._internal_kv_get(
            _prefix(self.run_id, key) + b"%010d" % number, namespace=NAMESPACE
        )
        if raw is None:  # cleared while reading: the run is over
            return
        self.applied[key] = number  # taken once, whatever it holds
        try:
            entry = json.loads(raw)
            if entry["by"] != self.replica:
                self.kept[key].adopt(
                    entry["shared"],
                    f"change {number}, made by another replica",
                    unless=lambda: self._unshared[key] > 0,
                )
        except (ValueError, KeyError, TypeError) as exc:  # not one this run's replicas wrote
            log.error("%s: change %d not applied: %s: %s",
                      key, number, type(exc).__name__, exc)  # fmt: skip
