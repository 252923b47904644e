"""A sequence survives its worker's death: the Triton runtimes' front keeps each live
sequence's requests since its START and, once a worker has lost its state (a death, a
restart: ``Recovery.epoch`` moved), sends them again in order to the new one, dropping
their answers, before the sequence's next request goes on. That request (the one in
flight at the death too, re-sent by ``Recovery``) is answered as if nothing happened.

Bounded: at most ``Recovery.sequence_replay`` requests per sequence are kept; a longer
sequence whose worker died cannot be rebuilt, and its next request is refused naming the
sequence and the bound. A sequence is forgotten at its END, and once idle for longer
than the model's ``max_sequence_idle_us`` (tritonserver has released it by then too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..batching.sequence import SequenceFlags
from ..errors import WorkerDied
from ..recovery import Lost, Recovery

__all__ = ["SequenceJournal"]

T = TypeVar("T")


@dataclass
class _Sequence:
    epoch: int
    """The ``Recovery.epoch`` its state on the worker was built in."""
    sent: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)
    """Each request answered since START, as a call that sends it again."""
    overflowed: bool = False
    last: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SequenceJournal:
    """One model's live sequences, for ``run``."""

    def __init__(
        self,
        model: str,
        recovery: Recovery,
        idle_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.recovery, self.idle_s, self._clock = model, recovery, idle_s, clock
        self._live: dict[int | str, _Sequence] = {}
        self.rebuilt = 0
        """Sequences whose state was rebuilt on a new worker."""

    def __len__(self) -> int:
        return len(self._live)

    async def run(
        self,
        flags: SequenceFlags,
        send: Callable[[], Awaitable[T]],
        lost: Callable[[T], Lost | None],
        answered: Callable[[T], bool],
        *,
        deadline: float,
        key: Callable[[], bytes],
    ) -> T:
        """``send`` one request of the sequence ``flags`` names, through ``Recovery`` (``lost``
        says what each attempt met), after rebuilding the sequence on a new worker where
        its state was lost; ``answered`` says whether an outcome is a success, which is
        then kept for the next rebuild."""
        recovery = self.recovery
        self._forget_idle()
        seq = self._live.get(flags.id)
        if flags.start:
            seq = self._live[flags.id] = _Sequence(recovery.epoch, last=self._clock())
        if seq is None:  # began before this front, or forgotten: passed on as it is
            return await recovery.replay(self.model, send, lost, deadline=deadline, key=key)
        async with seq.lock:
            seq.last = self._clock()

            async def attempt() -> T:
                if seq.epoch != recovery.epoch:
                    outcome = await self._rebuild(flags, seq, lost, answered)
                    if outcome is not None:
                        return outcome  # the worker died again while it was rebuilt
                return await send()

            try:
                outcome = await recovery.replay(
                    self.model, attempt, lost, deadline=deadline, key=key
                )
            finally:
                seq.last = self._clock()
            if answered(outcome):
                self._keep(flags, seq, send)
            return outcome

    async def _rebuild(
        self,
        flags: SequenceFlags,
        seq: _Sequence,
        lost: Callable[[Any], Lost | None],
        answered: Callable[[Any], bool],
    ) -> Any:
        """The sequence's requests sent again, in order; None once its state is back, or
        the outcome that met a worker's death (the attempt is lost)."""
        epoch = self.recovery.epoch
        if seq.overflowed:
            self._live.pop(flags.id, None)
            raise WorkerDied(
                f"model {self.model!r}: sequence {flags.id!r} lost its state when its worker "
                f"died and cannot be rebuilt: it ran more requests than the "
                f"{self.recovery.sequence_replay} kept ([server] max_sequence_replay); start it "
                "again"
            )
        for i, resend in enumerate(seq.sent):
            outcome = await resend()
            if lost(outcome) is not None:
                return outcome
            if not answered(outcome):
                self._live.pop(flags.id, None)
                raise WorkerDied(
                    f"model {self.model!r}: sequence {flags.id!r} lost its state when its "
                    f"worker died, and request {i + 1} of it failed when sent again to "
                    f"rebuild it: {outcome!r:.200}"
                )
        seq.epoch = epoch
        self.rebuilt += 1
        return None

    def _keep(
        self, flags: SequenceFlags, seq: _Sequence, send: Callable[[], Awaitable[Any]]
    ) -> None:
        if flags.end:
            if self._live.get(flags.id) is seq:
                del self._live[flags.id]
        elif len(seq.sent) < self.recovery.sequence_replay:
            seq.sent.append(send)
        else:
            seq.overflowed, seq.sent = True, []

    def _forget_idle(self) -> None:
        """Sequences idle past the model's idle time (and not running a request), counted
        from the last outage at the earliest: a client may have waited through it."""
        now, since = self._clock(), self.recovery.epoch_since
        idle = [
            sid
            for sid, seq in self._live.items()
            if now - max(seq.last, since) > self.idle_s and not seq.lock.locked()
        ]
        for sid in idle:
            del self._live[sid]
