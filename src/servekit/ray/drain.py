"""A clean stop on Ray: servekit drains its ingress replicas before Serve and Ray stop.

Ray Serve's own shutdown kills its proxies at once, so a request a proxy holds is cut
off. servekit stops in three steps instead, through a flag in Ray's GCS key-value store
(one per run of ``RayRuntime``, its ``run_id``, seen by every ingress replica on every
host; an app deployed otherwise, or by a later run, never sees an old flag):

1. ``begin``: every ingress replica answers readiness 503 at once (load balancers and
   Kubernetes stop sending), and for ``SETTLE_S`` more still serves what arrives: requests
   already on their way (in a proxy's queue) are not refused;
2. after that, a new request gets 503 (``ModelNotReady``: the server is stopping), and
   each replica reports itself drained once its last accepted request is answered;
3. ``wait`` returns when every ingress replica has reported, or at the deadline
   (``exit_timeout_s``); only then does the runtime stop Serve.
"""

from __future__ import annotations

import threading
import time

__all__ = ["SETTLE_S", "Gate", "begin", "clear", "wait"]

NAMESPACE = "servekit"
SETTLE_S = 1.0
"""How long a draining replica still serves new requests (those already on their way)."""
POLL_S = 0.1


def _draining(app: str) -> bytes:
    return f"{app}:draining".encode()


def _drained(app: str) -> bytes:
    return f"{app}:drained:".encode()


def clear(app: str) -> None:
    """Forget every key of ``app`` (a run's ``run_id``): its drain flag, the replicas'
    reports and its shared traffic (``servekit.ray.shared``)."""
    from ray.experimental import internal_kv as kv

    kv._internal_kv_del(f"{app}:".encode(), del_by_prefix=True, namespace=NAMESPACE)


def begin(app: str) -> None:
    """Tell every ingress replica of ``app`` to drain."""
    from ray.experimental import internal_kv as kv

    kv._internal_kv_put(_draining(app), b"1", namespace=NAMESPACE)


def wait(app: str, replicas: int, timeout_s: float) -> int:
    """Wait until ``replicas`` ingress replicas have drained, at most ``timeout_s``;
    returns how many did."""
    from ray.experimental import internal_kv as kv

    deadline = time.monotonic() + timeout_s
    while True:
        done = len(kv._internal_kv_list(_drained(app), namespace=NAMESPACE))
        if done >= replicas or time.monotonic() >= deadline:
            return done
        time.sleep(POLL_S)


class Gate:
    """One ingress replica's side: counts its requests in flight, watches the flag, and
    once draining has settled refuses new requests and reports when none is left."""

    def __init__(self, app: str | None, replica: str, poll_s: float = POLL_S) -> None:
        self.app, self.replica, self.poll_s = app, replica, poll_s
        self.in_flight = 0
        self.draining = False
        """The flag is up: readiness answers 503."""
        self.refusing = False
        """The flag has been up for ``SETTLE_S``: new requests get 503."""
        if app is not None:  # None: deployed without RayRuntime, nothing will drain it
            threading.Thread(target=self._watch, name="servekit-drain", daemon=True).start()

    def enter(self) -> bool:
        """Admit a request (False: refuse it); call ``leave`` when it is answered."""
        if self.refusing:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1

    def _watch(self) -> None:
        from ray.experimental import internal_kv as kv

        assert self.app is not None
        since = 0.0
        while True:
            time.sleep(self.poll_s)
            try:
                up = kv._internal_kv_exists(_draining(self.app), namespace=NAMESPACE)
            except Exception:  # the GCS is briefly unreachable: ask again next time
                continue
            if not up:
                self.draining = self.refusing = False
                continue
            if not self.draining:
                self.draining, since = True, time.monotonic()
            elif not self.refusing and time.monotonic() - since >= SETTLE_S:
                self.refusing = True  # admissions stop here; the count only falls from now
            elif self.refusing and self.in_flight == 0:
                key = _drained(self.app) + self.replica.encode()
                kv._internal_kv_put(key, b"1", namespace=NAMESPACE)
                return
