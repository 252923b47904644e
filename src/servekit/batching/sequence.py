"""Triton's sequence batcher, as a schedule on an injected clock: which request of which
sequence runs, on which instance and in which batch slot, and when a sequence ends.

A stateful model sees each sequence's requests in order, on one instance: requests carry
a sequence id with START on the first and END on the last. Two strategies, as Triton's:

- ``direct``: each instance has ``max_batch_size`` slots; a sequence holds one slot from
  its START to its END (or until it idles), and its requests run in that row of the
  instance's batches. A batch spans slots 0 to the highest one held; a held slot with no
  request waiting is sent READY 0. Sequences beyond the slots wait in a backlog, first
  come first served, and take the next slot freed.
- ``oldest``: each instance takes up to ``max_candidate_sequences`` sequences; its
  batches hold the oldest waiting request of each, oldest first, up to
  ``max_batch_size``, never two of one sequence.

Either way a batch waits for more requests up to ``max_queue_delay_us`` (0: it goes as
soon as its instance is free), a sequence with nothing waiting or running for
``max_sequence_idle_us`` is released, and each release says why: ``end``, ``idle`` or
``cancelled``. This module decides only; ``sequencer.SequenceBatcher`` runs the batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidInput
from ..tables import check_keys

__all__ = [
    "Controls",
    "Ended",
    "SequenceBatch",
    "SequenceFlags",
    "SequencePolicy",
    "SequenceSchedule",
    "StateSpec",
]

SequenceId = int | str
Reason = Literal["end", "idle", "cancelled"]


@dataclass(frozen=True)
class Controls:
    """The model's inputs that receive Triton's control values (None: not sent)."""

    start: str | None = None
    end: str | None = None
    ready: str | None = None
    corrid: str | None = None

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.start, self.end, self.ready, self.corrid) if n)


@dataclass(frozen=True)
class StateSpec:
    """Implicit state: servekit feeds ``output`` of one request back as ``input`` of the
    sequence's next; ``initial`` "zeros" at each START."""

    input: str
    output: str
    initial: str = "zeros"

    def __post_init__(self) -> None:
        if self.initial != "zeros":
            raise ValueError(f"state {self.input!r}: initial must be 'zeros', got {self.initial!r}")


@dataclass(frozen=True)
class SequencePolicy:
    """Triton's ``sequence_batching``, servekit's names for its fields."""

    strategy: Literal["direct", "oldest"] = "direct"
    max_sequence_idle_us: int = 1_000_000
    max_candidate_sequences: int = 4
    max_queue_delay_us: int = 0
    controls: Controls = field(default_factory=Controls)
    states: tuple[StateSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in ("direct", "oldest"):
            raise ValueError(f"strategy must be 'direct' or 'oldest', got {self.strategy!r}")
        if self.max_sequence_idle_us <= 0:
            raise ValueError(f"max_sequence_idle_us must be > 0, got {self.max_sequence_idle_us}")
        if self.max_candidate_sequences < 1:
            raise ValueError(
                f"max_candidate_sequences must be >= 1, got {self.max_candidate_sequences}"
            )
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if isinstance(self.controls, Mapping):
            object.__setattr__(self, "controls", Controls(**self.controls))
        object.__setattr__(
            self,
            "states",
            tuple(StateSpec(**s) if isinstance(s, Mapping) else s for s in self.states),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``[models.sequence_batching]`` table (``from_dict``'s inverse)."""
        data: dict[str, Any] = {
            "strategy": self.strategy,
            "max_sequence_idle_us": self.max_sequence_idle_us,
            "max_queue_delay_us": self.max_queue_delay_us,
        }
        if self.strategy == "oldest":
            data["max_candidate_sequences"] = self.max_candidate_sequences
        controls = {k: v for k, v in vars(self.controls).items() if v}
        if controls:
            data["controls"] = controls
        if self.states:
            data["state"] = [vars(s).copy() for s in self.states]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str) -> SequencePolicy:
        """A policy from its table (``state``: a list of ``{input, output, initial}``
        tables); unknown keys are named with their section."""
        check_keys(
            section,
            data,
            {"strategy", "max_sequence_idle_us", "max_candidate_sequences",
             "max_queue_delay_us", "controls", "state"},
            cls,
        )  # fmt: skip
        kwargs = {k: v for k, v in data.items() if k not in ("controls", "state")}
        controls = data.get("controls", {})
        if not isinstance(controls, Mapping):
            raise ValueError(f"{section}.controls: expected a table, got {controls!r}")
        check_keys(f"{section}.controls", controls, {"start", "end", "ready", "corrid"}, Controls)
        states = data.get("state", [])
        if not isinstance(states, Sequence) or isinstance(states, str):
            raise ValueError(f"[[{section}.state]]: expected a list of tables, got {states!r}")
        for i, state in enumerate(states):
            check_keys(f"{section}.state.{i}", state, {"input", "output", "initial"}, StateSpec)
        return cls(controls=Controls(**controls), states=tuple(states), **kwargs)

    def to_triton(self, msg: Any, inputs: Mapping[str, Any]) -> None:
        """Fill config.pbtxt's ``sequence_batching`` (a ``ModelSequenceBatching``); each
        control's and state's dtype is the model's input's (``inputs``: name -> TensorSpec)."""
        from tritonclient.grpc import model_config_pb2 as pb

        msg.SetInParent()
        msg.max_sequence_idle_microseconds = self.max_sequence_idle_us
        if self.strategy == "direct":
            msg.direct.SetInParent()
            msg.direct.max_queue_delay_microseconds = self.max_queue_delay_us
        else:
            msg.oldest.max_candidate_sequences = self.max_candidate_sequences
            msg.oldest.max_queue_delay_microseconds = self.max_queue_delay_us
        kinds = pb.ModelSequenceBatching.Control
        c = self.controls
        for kind, name in (
            (kinds.CONTROL_SEQUENCE_START, c.start),
            (kinds.CONTROL_SEQUENCE_END, c.end),
            (kinds.CONTROL_SEQUENCE_READY, c.ready),
            (kinds.CONTROL_SEQUENCE_CORRID, c.corrid),
        ):
            if not name:
                continue
            datatype = inputs[name].dtype.datatype
            control = msg.control_input.add(name=name).control.add(kind=kind)
            if kind == kinds.CONTROL_SEQUENCE_CORRID:
                control.data_type = pb.DataType.Value(inputs[name].dtype.triton)
            elif datatype == "FP32":
                control.fp32_false_true.extend([0.0, 1.0])
            elif datatype == "BOOL":
                control.bool_false_true.extend([False, True])
            else:
                control.int32_false_true.extend([0, 1])
        for state in self.states:
            tensor = inputs[state.input]
            kept = msg.state.add(
                input_name=state.input,
                output_name=state.output,
                data_type=pb.DataType.Value(tensor.dtype.triton),
                dims=list(tensor.shape),
            )
            kept.initial_state.add(
                data_type=kept.data_type, dims=list(tensor.shape), zero_data=True, name="zeros"
            )


@dataclass(frozen=True)
class SequenceFlags:
    """What a request says of its sequence (KServe parameters ``sequence_id``,
    ``sequence_start``, ``sequence_end``)."""

    id: SequenceId
    start: bool = False
    end: bool = False


@dataclass
class _Waiting:
    key: Any
    flags: SequenceFlags
    arrived: float


@dataclass(eq=False)
class _Sequence:
    id: SequenceId
    waiting: deque[_Waiting] = field(default_factory=deque)
    instance: int | None = None
    slot: int | None = None
    running: bool = False
    ending: bool = False
    """Its END was submitted: a request after it must START again."""
    last: float = 0.0


@dataclass(frozen=True)
class Ended:
    """A sequence released, and why; ``keys``: its requests still waiting, now failed."""

    id: SequenceId
    reason: Reason
    instance: int | None
    keys: tuple[Any, ...] = ()


@dataclass(frozen=True)
class SequenceBatch:
    """One batch for one instance: per row, ``(key, flags)`` of its request, or None for a
    held slot with no request (``direct``: READY 0)."""

    instance: int
    rows: tuple[tuple[Any, SequenceFlags] | None, ...]

    @property
    def keys(self) -> list[Any]:
        return [row[0] for row in self.rows if row is not None]


class SequenceSchedule:
    """The sequence batcher's decisions for ``instances`` instances of a model whose
    batches hold at most ``max_batch_size`` rows; every time is ``clock()`` seconds."""

    def __init__(
        self,
        policy: SequencePolicy,
        *,
        instances: int,
        max_batch_size: int,
        clock: Callable[[], float],
        name: str = "model",
    ) -> None:
        if instances < 1 or max_batch_size < 1:
            raise ValueError("a sequence batcher needs instances >= 1 and max_batch_size >= 1")
        self.policy, self.name, self.clock = policy, name, clock
        self.max_batch_size = max_batch_size
        places = max_batch_size if policy.strategy == "direct" else policy.max_candidate_sequences
        self.places: list[list[_Sequence | None]] = [[None] * places for _ in range(instances)]
        """Per instance: its slots (direct) or candidate places (oldest)."""
        self.busy = [False] * instances
        self.sequences: dict[SequenceId, _Sequence] = {}
        self.backlog: deque[_Sequence] = deque()
        self._running: dict[Any, _Sequence] = {}
        """Request key -> its sequence, from ``take`` to ``done``."""
        self._idle_s = policy.max_sequence_idle_us / 1e6
        self._delay_s = policy.max_queue_delay_us / 1e6

    # ------------------------------------------------------------------ requests
    def submit(self, key: Any, flags: SequenceFlags) -> None:
        """Queue a request; ``InvalidInput`` naming the sequence where Triton refuses it."""
        if flags.id in (0, ""):
            raise InvalidInput(
                f"inference request to model {self.name!r} must specify a non-zero or "
                "non-empty sequence_id"
            )
        sequence = self.sequences.get(flags.id)
        if not flags.start and (sequence is None or sequence.ending):
            if sequence is not None:
                raise InvalidInput(
                    f"sequence {flags.id!r} of model {self.name!r} has ended: a request after "
                    "its END must set sequence_start to begin a new one"
                )
            raise InvalidInput(
                f"inference request for sequence {flags.id!r} to model {self.name!r} must "
                "specify the START flag on the first request of the sequence"
            )
        now = self.clock()
        if sequence is None:
            sequence = self.sequences[flags.id] = _Sequence(flags.id, last=now)
            if not self._place(sequence):
                self.backlog.append(sequence)
        sequence.waiting.append(_Waiting(key, flags, now))
        sequence.ending = flags.end
        sequence.last = now

    def cancel(self, key: Any) -> Ended | None:
        """The caller of request ``key`` left: its sequence is released at once (its
        order is broken), with its other waiting requests; None if ``key`` is not here."""
        sequence = self._running.get(key)
        if sequence is None:
            sequence = next(
                (s for s in self.sequences.values() if any(w.key == key for w in s.waiting)),
                None,
            )
        if sequence is None or self.sequences.get(sequence.id) is not sequence:
            return None
        others = tuple(w.key for w in sequence.waiting if w.key != key)
        sequence.waiting.clear()
        return self._release(sequence, "cancelled", others)

    # ------------------------------------------------------------------ batches
    def take(self) -> list[SequenceBatch]:
        """The batches to start now, one per free instance that has one due."""
        now = self.clock()
        batches = []
        for instance, places in enumerate(self.places):
            if self.busy[instance]:
                continue
            ready = [s for s in places if s is not None and s.waiting and not s.running]
            if not ready or not self._due(ready, places, now):
                continue
            if self.policy.strategy == "direct":
                top = max(i for i, s in enumerate(places) if s is not None)
                rows = [self._row(s) if s in ready else None for s in places[: top + 1]]
            else:
                ready.sort(key=lambda s: s.waiting[0].arrived)
                rows = [self._row(s) for s in ready[: self.max_batch_size]]
            self.busy[instance] = True
            batches.append(SequenceBatch(instance, tuple(rows)))
        return batches

    def _due(self, ready: list[_Sequence], places: list[_Sequence | None], now: float) -> bool:
        if self._delay_s == 0:
            return True
        held = sum(1 for s in places if s is not None and not s.running)
        if len(ready) >= min(held, self.max_batch_size):
            return True
        return now >= min(s.waiting[0].arrived for s in ready) + self._delay_s

    def _row(self, sequence: _Sequence) -> tuple[Any, SequenceFlags]:
        waiting = sequence.waiting.popleft()
        sequence.running = True
        self._running[waiting.key] = sequence
        return waiting.key, waiting.flags

    def done(self, batch: SequenceBatch) -> list[Ended]:
        """``batch`` finished (whatever its outcome): its instance is free, and the
        sequences whose END it ran are released."""
        now = self.clock()
        self.busy[batch.instance] = False
        ended = []
        for row in batch.rows:
            if row is None:
                continue
            sequence = self._running.pop(row[0], None)
            if sequence is None or self.sequences.get(sequence.id) is not sequence:
                continue  # cancelled while it ran: released then
            sequence.running = False
            sequence.last = now
            if row[1].end and not sequence.waiting:
                ended.append(self._release(sequence, "end"))
            elif row[1].end:  # a new sequence under the same id STARTs in the same place
                ended.append(Ended(sequence.id, "end", sequence.instance))
        return ended

    def expire(self) -> list[Ended]:
        """Release the sequences idle for ``max_sequence_idle_us``."""
        now = self.clock()
        idle = [
            s
            for s in self.sequences.values()
            if s.instance is not None
            and not s.waiting
            and not s.running
            and now - s.last >= self._idle_s
        ]
        return [self._release(s, "idle") for s in idle]

    def next_wake(self) -> float | None:
        """When ``take`` or ``expire`` may next have something that they lack now."""
        times = [
            s.last + self._idle_s
            for s in self.sequences.values()
            if s.instance is not None and not s.waiting and not s.running
        ]
        if self._delay_s:
            times += [
                s.waiting[0].arrived + self._delay_s
                for places in self.places
                for s in places
                if s is not None and s.waiting and not s.running
            ]
        return min(times, default=None)

    @property
    def pending(self) -> int:
        """Requests waiting, in held places and in the backlog."""
        return sum(len(s.waiting) for s in self.sequences.values())

    # ------------------------------------------------------------------ places
    def _place(self, sequence: _Sequence) -> bool:
        """Give ``sequence`` a free place (on the instance with the most free, the lowest
        free slot there); False if there is none."""
        most, instance = max((places.count(None), -i) for i, places in enumerate(self.places))
        if most == 0:
            return False
        places = self.places[-instance]
        slot = places.index(None)
        places[slot] = sequence
        sequence.instance, sequence.slot = -instance, slot
        return True

    def _release(self, sequence: _Sequence, reason: Reason, keys: tuple[Any, ...] = ()) -> Ended:
        del self.sequences[sequence.id]
        instance = sequence.instance
        if instance is not None and sequence.slot is not None:
            self.places[instance][sequence.slot] = None
        elif sequence in self.backlog:
            self.backlog.remove(sequence)
        ended = Ended(sequence.id, reason, instance, keys)
        while self.backlog and self._place(self.backlog[0]):
            self.backlog.popleft()
        return ended
