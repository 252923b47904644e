"""The sequence batcher's schedule (``batching.sequence``) on a fake clock: random
interleavings of sequences, time and finished batches on both strategies, against what
Triton promises: each sequence's requests run in order, one at a time, on one instance
(and, ``direct``, in one slot); never two of one sequence in a batch; a sequence beyond
the places waits in a first-come backlog; an idle one is released once
``max_sequence_idle_us`` has passed and not before; and every request admitted is run
or failed, none lost."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from servekit.batching.sequence import (
    SequenceFlags,
    SequencePolicy,
    SequenceSchedule,
)
from servekit.errors import InvalidInput

IDLE_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Schedules(RuleBasedStateMachine):
    @initialize(
        strategy=st.sampled_from(["direct", "oldest"]),
        instances=st.integers(1, 3),
        max_batch_size=st.integers(1, 4),
        candidates=st.integers(1, 4),
        delay_us=st.sampled_from([0, 0, 200_000]),
    )
    def setup(self, strategy, instances, max_batch_size, candidates, delay_us):
        self.clock = Clock()
        self.policy = SequencePolicy(
            strategy=strategy,
            max_sequence_idle_us=int(IDLE_S * 1e6),
            max_candidate_sequences=candidates,
            max_queue_delay_us=delay_us,
        )
        self.schedule = SequenceSchedule(
            self.policy, instances=instances, max_batch_size=max_batch_size, clock=self.clock
        )
        self.max_batch_size = max_batch_size
        self.next_id = 1
        self.open: dict[int, int] = {}  # client side: sequence id -> requests sent
        self.sent: dict[tuple, SequenceFlags] = {}  # key -> flags; key = (id, generation, i)
        self.generation: dict[int, int] = {}
        self.ran: list[tuple] = []  # keys in the order they were taken
        self.failed: set[tuple] = set()
        self.running: list = []  # batches taken and not done
        self.placed_at: dict[tuple[int, int], tuple[int, int | None]] = {}
        self.released: dict[tuple[int, int], str] = {}
        self.started_order: list[tuple[int, int]] = []

    # ---------------------------------------------------------------- clients
    def _send(self, sid: int, start: bool, end: bool) -> None:
        gen = self.generation[sid]
        key = (sid, gen, self.open.get(sid, 0))
        flags = SequenceFlags(sid, start=start, end=end)
        self.schedule.submit(key, flags)
        self.sent[key] = flags
        self.open[sid] = self.open.get(sid, 0) + 1
        if end:
            del self.open[sid]

    @rule(length=st.integers(1, 4))
    def start_sequence(self, length):
        sid = self.next_id
        self.next_id += 1
        self.generation[sid] = 0
        self.open[sid] = 0
        self.started_order.append((sid, 0))
        self.lengths = getattr(self, "lengths", {})
        self.lengths[(sid, 0)] = length
        self._send(sid, True, length == 1)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def continue_sequence(self, data):
        sid = data.draw(st.sampled_from(sorted(self.open)))
        gen = self.generation[sid]
        if (sid, gen) in self.released:  # released (idle): Triton refuses the next request
            with pytest.raises(InvalidInput, match="START flag"):
                self.schedule.submit(("x", sid), SequenceFlags(sid))
            del self.open[sid]
            return
        n = self.open[sid]
        self._send(sid, False, n + 1 >= self.lengths[(sid, gen)])

    @rule()
    def a_request_without_start_or_id_is_refused(self):
        with pytest.raises(InvalidInput, match="START flag"):
            self.schedule.submit(("never",), SequenceFlags(10**9))
        with pytest.raises(InvalidInput, match="non-zero"):
            self.schedule.submit(("never",), SequenceFlags(0, start=True))

    # ---------------------------------------------------------------- server
    @rule(dt=st.sampled_from([0.05, 0.3, 0.7, 1.2]))
    def time_passes(self, dt):
        self.clock.now += dt
        for ended in self.schedule.expire():
            self._ended(ended)

    def _ended(self, ended):
        gen = self.generation[ended.id]
        assert (ended.id, gen) not in self.released
        self.released[(ended.id, gen)] = ended.reason
        self.failed.update(ended.keys)

    @rule()
    def take(self):
        for batch in self.schedule.take():
            assert all(b.instance != batch.instance for b in self.running), "instance busy"
            assert len(batch.rows) <= self.max_batch_size
            keys = batch.keys
            assert keys, "an empty batch"
            ids = [k[0] for k in keys]
            assert len(ids) == len(set(ids)), f"two requests of one sequence in {batch}"
            for slot, row in enumerate(batch.rows):
                if row is None:
                    assert self.policy.strategy == "direct"
                    continue
                key, flags = row
                assert flags == self.sent[key]
                sid, gen, i = key
                previous = [k for k in self.ran if k[:2] == (sid, gen)]
                assert [k[2] for k in previous] == list(range(i)), f"{key} out of order"
                for b in self.running:  # nothing of this sequence still running
                    assert all(k[:2] != (sid, gen) for k in b.keys)
                where = (batch.instance, slot if self.policy.strategy == "direct" else None)
                assert self.placed_at.setdefault((sid, gen), where) == where
                self.ran.append(key)
            self.running.append(batch)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        batch = data.draw(st.sampled_from(self.running))
        self.running.remove(batch)
        for ended in self.schedule.done(batch):
            self._ended(ended)
            if ended.reason == "end":
                key = next(k for k in batch.keys if k[0] == ended.id)
                assert self.sent[key].end

    @precondition(lambda self: self.running or self.schedule.pending)
    @rule()
    def a_client_leaves(self):
        key = next(iter(b.keys[0] for b in self.running), None)
        if key is None:
            key = next(k for k in self.sent if k not in self.ran and k not in self.failed)
        ended = self.schedule.cancel(key)
        if ended is not None:
            assert ended.reason == "cancelled"
            self._ended(ended)
            self.failed.add(key)
            self.open.pop(key[0], None)

    # ---------------------------------------------------------------- promises
    @invariant()
    def an_idle_sequence_is_released_in_time_and_not_before(self):
        if not hasattr(self, "schedule"):
            return
        now = self.clock.now
        for sequence in self.schedule.sequences.values():
            if sequence.instance is not None and not sequence.waiting and not sequence.running:
                assert now - sequence.last < IDLE_S, f"{sequence.id} idle and kept"

    @invariant()
    def the_backlog_is_first_come_first_served(self):
        if not hasattr(self, "schedule"):
            return
        backlog = [s.id for s in self.schedule.backlog]
        order = [sid for sid, _ in self.started_order if sid in backlog]
        assert backlog == order
        if backlog:  # nobody waits while a place is free
            assert all(None not in places for places in self.schedule.places)

    def teardown(self):
        if not hasattr(self, "schedule"):
            return
        # Drain: finish what runs, let time pass, take again, until nothing is left.
        for _ in range(200):
            while self.running:
                self.finish_all()
            self.clock.now += 0.25
            for ended in self.schedule.expire():
                self._ended(ended)
            self.take()
            if not self.running and not self.schedule.pending:
                break
        assert not self.schedule.pending and not self.running
        lost = set(self.sent) - set(self.ran) - self.failed
        assert not lost, f"requests neither run nor failed: {sorted(lost)}"

    def finish_all(self):
        batch = self.running.pop(0)
        for ended in self.schedule.done(batch):
            self._ended(ended)


TestSchedules = Schedules.TestCase
TestSchedules.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_direct_fills_slots_on_the_instance_with_most_free_and_marks_empty_ones():
    clock = Clock()
    schedule = SequenceSchedule(
        SequencePolicy("direct"), instances=2, max_batch_size=2, clock=clock
    )
    for sid in (1, 2, 3):
        schedule.submit(("a", sid), SequenceFlags(sid, start=True))
    where = {s.id: (s.instance, s.slot) for s in schedule.sequences.values()}
    assert where == {1: (0, 0), 2: (1, 0), 3: (0, 1)}
    schedule.submit(("b", 1), SequenceFlags(1))  # queued behind its first
    batches = {b.instance: b for b in schedule.take()}
    assert [r[0] for r in batches[0].rows] == [("a", 1), ("a", 3)]
    assert [r[0] for r in batches[1].rows] == [("a", 2)]
    schedule.done(batches[0])
    (again,) = schedule.take()  # sequence 3 has nothing waiting: READY 0 in its slot
    assert again.rows[0][0] == ("b", 1) and again.rows[1] is None


def test_a_request_after_end_must_start_again():
    clock = Clock()
    schedule = SequenceSchedule(SequencePolicy(), instances=1, max_batch_size=1, clock=clock)
    schedule.submit("first", SequenceFlags(7, start=True, end=True))
    with pytest.raises(InvalidInput, match="has ended"):
        schedule.submit("late", SequenceFlags(7))
    schedule.submit("again", SequenceFlags(7, start=True))
    (batch,) = schedule.take()
    (ended,) = schedule.done(batch)
    assert (ended.id, ended.reason) == (7, "end")  # told, though 7 STARTs again in place
    (batch,) = schedule.take()
    assert batch.keys == ["again"]


def test_a_sequence_string_id_and_idle_release_say_why():
    clock = Clock()
    schedule = SequenceSchedule(
        SequencePolicy(max_sequence_idle_us=500_000), instances=1, max_batch_size=1, clock=clock
    )
    schedule.submit("a", SequenceFlags("user-1", start=True))
    schedule.submit("b", SequenceFlags("user-2", start=True))  # backlog: one slot
    (batch,) = schedule.take()
    schedule.done(batch)
    assert schedule.next_wake() == pytest.approx(0.5)
    clock.now = 0.49
    assert schedule.expire() == []
    clock.now = 0.5
    (ended,) = schedule.expire()
    assert (ended.id, ended.reason) == ("user-1", "idle")
    (batch,) = schedule.take()  # the backlog's sequence took the freed slot
    assert batch.keys == ["b"]
