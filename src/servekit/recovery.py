"""Requests that outlive a crashed worker, and inputs that keep crashing one.

Inference on a served model is idempotent, so a request in flight to a worker process
that died (a Triton backend stub, tritonserver itself, a Ray replica) is sent again, to
a live instance or the restarted one, until its own deadline: the KServe ``timeout``
parameter, else ``[server] request_timeout_s``. Past it the client gets ``WorkerDied``
(504 / DEADLINE_EXCEEDED) saying so. A request that was in flight in ``max_worker_deaths``
deaths is not sent again: it gets ``PoisonInput`` (400), and its fingerprint (model and
request bytes) is kept, so the same input is refused at once after that instead of
crash-looping the fleet.

After its first death a request is a *suspect*: suspects are re-sent one at a time per
model, so a poison input's second death is its own, and the requests that only shared a
batch with it are answered. ``Recovery`` decides; the runtime's adapter sends and says
what each attempt met (``Lost``): an answer, a death in flight, or no live worker yet.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import numpy as np

from . import tracing
from .errors import PoisonInput, WorkerDied

__all__ = ["Lost", "Recovery", "RECOVERY_METRICS", "fingerprint", "tensors_key"]

T = TypeVar("T")

QUARANTINE_KEPT = 1024
"""Fingerprints of poison inputs remembered (the oldest forgotten first)."""
_BACKOFF_S = (0.02, 0.5)
"""First and longest wait between attempts while no worker is live."""


class Lost(enum.Enum):
    """What an attempt met, when it was not answered."""

    IN_FLIGHT = "the worker died with the request in flight"
    DEAD = "the worker was found dead"
    """A death in flight only if the worker was thought live when the request was sent:
    a dead Triton stub answers every request so until it is restarted, and the restart
    drops the connections of requests sent meanwhile."""
    UNREACHABLE = "no live worker took the request"


def fingerprint(model: str, *parts: bytes) -> bytes:
    """The identity of one input to one model, for quarantine (not for security)."""
    h = hashlib.blake2b(model.encode(), digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def tensors_key(model: str, version: str, inputs: Mapping[str, np.ndarray]) -> Callable[[], bytes]:
    """``fingerprint`` of tensors (names, dtypes, shapes and data), made only when called:
    ``Recovery.refuse_poison`` asks for it once something has been quarantined."""

    def key() -> bytes:
        h = hashlib.blake2b(f"{model}\0{version}".encode(), digest_size=16)
        for name in sorted(inputs):
            a = np.ascontiguousarray(inputs[name])
            h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}".encode())
            h.update(a.data if a.dtype.kind != "O" else repr(a.tolist()).encode())
        return h.digest()

    return key


@dataclass
class _Model:
    deaths: int = 0
    replayed: int = 0
    quarantined: int = 0
    down_s: float = 0.0
    down_since: float | None = None
    suspects: asyncio.Lock | None = None


class Recovery:
    """Replays requests a worker death cost, quarantines inputs that kill workers, and
    counts both (``figures``: Prometheus families, ``RECOVERY_METRICS``)."""

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        max_deaths: int = 2,
        sequence_replay: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0 or max_deaths < 1 or sequence_replay < 0:
            raise ValueError(
                f"request_timeout_s must be > 0, max_worker_deaths >= 1 and "
                f"max_sequence_replay >= 0, got {timeout_s}, {max_deaths} and {sequence_replay}"
            )
        self.timeout_s, self.max_deaths, self._clock = timeout_s, max_deaths, clock
        self.sequence_replay = sequence_replay
        """Requests of a live sequence kept to rebuild its state on a new worker
        (``servekit.front.journal``); 0 keeps none."""
        self.epoch = 0
        """Counts the times workers may have lost their state (an outage first seen, a
        restart): a sequence's state built in an earlier epoch is gone."""
        self.epoch_since = clock()
        """When ``epoch`` last moved: idle time counts from here for a sequence kept across
        an outage, which kept its client waiting."""
        self._models: dict[str, _Model] = {}
        self._poison: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._paused = False

    def _model(self, name: str) -> _Model:
        m = self._models.get(name)
        if m is None:
            m = self._models[name] = _Model()
        return m

    def deadline(self, timeout_us: int | None, arrived: float) -> float:
        """When a request that arrived at ``arrived`` stops being re-sent."""
        timeout_s = timeout_us / 1e6 if timeout_us else self.timeout_s
        return arrived + timeout_s

    def refuse_poison(self, model: str, key: Callable[[], bytes]) -> None:
        """Raise ``PoisonInput`` if this input crashed ``model``'s workers before. ``key``
        makes the fingerprint, only once any input has been quarantined."""
        if not self._poison:
            return
        digest = key()
        why = self._poison.get(digest)
        if why is not None:
            self._model(model).quarantined += 1
            raise PoisonInput(why)

    def answered(self, model: str) -> None:
        """An attempt was answered: a worker is live."""
        m = self._models.get(model)
        if m is not None and m.down_since is not None:
            m.down_s += self._clock() - m.down_since
            m.down_since = None

    def live(self, model: str) -> bool:
        """Whether no request has seen ``model``'s worker gone since the last answer."""
        m = self._models.get(model)
        return m is None or m.down_since is None

    def restarting(self) -> None:
        """The runtime is restarting its workers (any thread): nothing is re-sent until
        ``restarted``, so no replay reaches the new workers before they count as live."""
        self._paused = True

    def restarted(self) -> None:
        """The runtime started its workers again (any thread): every model's outage is over."""
        for name in list(self._models):
            self.answered(name)
        self.epoch, self.epoch_since = self.epoch + 1, self._clock()
        self._paused = False

    def _lost(self, model: str) -> None:
        m = self._model(model)
        if m.down_since is None:  # the first request to see a worker gone: one death
            m.deaths += 1
            m.down_since = self._clock()
            self.epoch, self.epoch_since = self.epoch + 1, m.down_since

    async def replay(
        self,
        model: str,
        send: Callable[[], Awaitable[T]],
        lost: Callable[[Any], Lost | None],
        *,
        deadline: float,
        key: Callable[[], bytes],
        first: T | None = None,
        first_sent_live: bool = True,
    ) -> T:
        """``send`` until an attempt is answered (``lost`` says None), a death in flight
        was the request's ``max_deaths``-th (``PoisonInput``) or ``deadline`` passed
        (``WorkerDied``). ``first``: the outcome of an attempt already made, and whether
        the model's worker was thought live when it was sent (``live``)."""
        m = self._model(model)
        deaths, wait, resent = 0, _BACKOFF_S[0], False
        outcome, sent_up = first, first_sent_live
        lost_at: float | None = None
        while True:
            if outcome is not None:
                why = lost(outcome)
                if why is None:
                    self.answered(model)
                    if lost_at is not None:  # the request's trace shows what the loss cost
                        tracing.child("replay", lost_at, time.monotonic(), deaths=deaths)
                    return outcome
                if lost_at is None:
                    lost_at = time.monotonic()
                if why is Lost.DEAD and not sent_up:
                    why = Lost.UNREACHABLE  # sent to a worker already known dead
                self._lost(model)
                if why is not Lost.UNREACHABLE:
                    deaths += 1
                    if deaths >= self.max_deaths:
                        return self._quarantine(model, key(), deaths)
                now = self._clock()
                if now >= deadline:
                    raise WorkerDied(
                        f"model {model!r}: {why.value}, and no live worker answered within "
                        f"the request's deadline ({deaths} death(s) in flight)"
                    )
                if not resent:
                    m.replayed, resent = m.replayed + 1, True
                await asyncio.sleep(min(wait, deadline - now))
                wait = min(wait * 2, _BACKOFF_S[1])
                while self._paused and self._clock() < deadline:
                    await asyncio.sleep(_BACKOFF_S[0])
            if deaths:  # a suspect: one at a time, so a second death is its own
                if m.suspects is None:
                    m.suspects = asyncio.Lock()
                async with m.suspects:
                    if self._clock() >= deadline:  # waited its turn past the deadline
                        raise WorkerDied(
                            f"model {model!r}: the worker died with the request in flight, "
                            "and its deadline passed while it waited to be re-sent"
                        )
                    sent_up = m.down_since is None
                    outcome = await send()
            else:
                sent_up = m.down_since is None
                outcome = await send()

    def _quarantine(self, model: str, digest: bytes, deaths: int) -> NoReturn:
        why = (
            f"model {model!r}: its worker died {deaths} times with this request in flight; "
            "it is not sent again, and the same input is refused from now on"
        )
        self._poison[digest] = why
        while len(self._poison) > QUARANTINE_KEPT:
            self._poison.popitem(last=False)
        self._model(model).quarantined += 1
        raise PoisonInput(why)

    def figures(self) -> Iterable[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """The counters as Prometheus families, per model (``Metrics.collect``)."""
        now = self._clock()
        rows = sorted(self._models.items())
        for name, (kind, about, read) in RECOVERY_METRICS.items():
            samples = [({"model": model}, float(read(m, now))) for model, m in rows]
            yield name, kind, about, samples


RECOVERY_METRICS: dict[str, tuple[str, str, Callable[[_Model, float], float]]] = {
    "servekit_worker_deaths_total": (
        "counter",
        "Times a model's worker was seen gone by a request (one per outage)",
        lambda m, now: m.deaths,
    ),
    "servekit_requests_replayed_total": (
        "counter",
        "Requests sent again after their worker died or none was live",
        lambda m, now: m.replayed,
    ),
    "servekit_requests_quarantined_total": (
        "counter",
        "Requests refused as poison: their worker died with them in flight too often",
        lambda m, now: m.quarantined,
    ),
    "servekit_no_live_worker_seconds_total": (
        "counter",
        "Seconds from a request seeing the worker gone to the next answer",
        lambda m, now: m.down_s + (now - m.down_since if m.down_since is not None else 0.0),
    ),
}
"""Name -> (kind, help, reader) of the series ``Recovery.figures`` yields."""
