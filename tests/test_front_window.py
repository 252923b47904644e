"""The Triton fronts' window (``front.window``) as a specification: whatever order
requests arrive, leave, time out and are answered in, at most ``limit`` are with
tritonserver, a request whose client left or whose queue timeout passed while waiting is
never sent, every other one is sent once and in arrival order, and the counts add up;
shedding never locks itself on."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit import DeadlineExceeded, QueuePolicy, Shed
from servekit.front.window import Window, limit_from_triton, window_limit

# An op: ("arrive",), ("leave", k), ("answer", k), ("expire", k): k picks among those
# arrived / sent.
ops = st.lists(
    st.one_of(
        st.just(("arrive", 0)),
        st.tuples(st.just("leave"), st.integers(0, 50)),
        st.tuples(st.just("answer"), st.integers(0, 50)),
        st.tuples(st.just("expire"), st.integers(0, 50)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), ops)
def test_the_window_never_holds_more_than_its_limit_and_never_sends_one_that_left(limit, script):
    asyncio.run(_play(limit, script))


async def _play(limit: int, script: list[tuple[str, int]]) -> None:
    # Each request's queue timeout is an hour: its timer is set but never fires by itself;
    # "expire" runs what the timer would run.
    w = Window("m", limit, queue=QueuePolicy(default_timeout_us=3_600_000_000))
    sent_order: list[int] = []
    slots: list = []
    left: set[int] = set()
    left_waiting: set[int] = set()
    expired: set[int] = set()
    answered: set[int] = set()
    for op, k in script:
        if op == "arrive":
            i = len(slots)
            slots.append(
                w.enter(lambda i=i: sent_order.append(i), fail=lambda e, i=i: expired.add(i))
            )
        elif op == "expire" and slots:  # also one sent, left or expired: a timer late
            i = k % len(slots)
            if slots[i].timer is not None:
                slots[i].timer.cancel()
            w._expire(slots[i], 1)
        elif op == "leave" and slots:
            i = k % len(slots)
            if i not in left and i not in answered and i not in expired:
                left.add(i)
                if i not in sent_order:
                    left_waiting.add(i)
                w.leave(slots[i])
        elif op == "answer":
            out = [i for i in sent_order if i not in answered]
            if out:
                i = out[k % len(out)]
                answered.add(i)
                w.done(slots[i])
        with_server = [i for i in sent_order if i not in answered]
        assert w.sent == len(with_server) <= limit
        assert not set(sent_order) & left_waiting, "sent after its client left"
        assert not set(sent_order) & expired, "sent after its timeout passed"
        settled = set(sent_order) | left | expired
        assert all(slots[i].timer is None for i in settled), "a timer left running"
    assert len(sent_order) == len(set(sent_order)), "a request sent twice"
    assert sent_order == sorted(sent_order), "sent out of arrival order"
    gone = left | expired
    waiting = [i for i in range(len(slots)) if i not in sent_order and i not in gone]
    assert w.queued == len(waiting)
    assert w.timed_out == len(expired)
    # Everyone still waiting is waiting only because the window is full.
    assert not waiting or w.sent == limit
    assert w.abandoned_queued == len([i for i in left if i not in sent_order])
    assert w.abandoned_forwarded == len([i for i in left if i in sent_order])


def test_a_request_woken_then_cancelled_before_it_sends_is_queued_not_forwarded():
    async def main():
        w = Window("m", 1)
        first = await w.wait()
        second = asyncio.ensure_future(w.wait())
        await asyncio.sleep(0)
        third = asyncio.ensure_future(w.wait())
        await asyncio.sleep(0)
        w.done(first)  # wakes the second ...
        second.cancel()  # ... which leaves before it runs
        await asyncio.sleep(0)
        slot = await asyncio.wait_for(third, 1)  # the slot went on to the third
        assert w.sent == 1 and w.queued == 0
        assert (w.abandoned_queued, w.abandoned_forwarded) == (1, 0)
        w.done(slot)
        assert w.sent == 0

    asyncio.run(main())


def test_a_failure_sending_one_on_answers_it_and_keeps_the_window():
    w = Window("m", 1)
    answers: list = []
    first = w.send(lambda finish: None, answers.append, None)  # with tritonserver
    assert first is not None

    def broken(finish):
        raise RuntimeError("no connection")

    w.send(broken, answers.append, None)  # waits; fails when its turn comes
    assert w.queued == 1
    w.done(first.args[0])  # the first answered: the second's turn (``first`` is its leave)
    assert len(answers) == 1 and "could not send it on" in str(answers[0])
    assert w.sent == 0 and w.queued == 0


def test_shedding_never_locks_itself_on_after_one_slow_answer():
    w = Window("m", 4, shed_late=True)
    w.pace.ran(5.0)  # one answer took 5 s
    # Nothing forwarded: a request with 0.1 s left still goes, and measures afresh.
    slot = w.enter(lambda: None, due_s=0.1)
    second = None
    try:
        w.enter(lambda: None, due_s=0.1)
    except Shed as exc:  # one is with tritonserver: now it judges
        second = exc
    assert second is not None and second.retry_after_s >= 1
    w.done(slot)
    assert w.pace.service_s < 5.0


def test_the_limit_is_two_full_batches_per_instance_unless_tritonserver_orders_the_queue():
    assert window_limit(32, 1) == 64 and window_limit(0, 2) == 4
    config = {"max_batch_size": 8, "instance_group": [{"count": 2}, {"count": 1}]}
    assert limit_from_triton(config) == 48
    for ordered in (
        {"dynamic_batching": {"priority_levels": 2}},
        {"dynamic_batching": {"default_queue_policy": {"max_queue_size": 4}}},
        {
            "dynamic_batching": {
                "default_queue_policy": {
                    "default_timeout_microseconds": "5",
                    "timeout_action": "DELAY",
                }
            }
        },
        {
            "dynamic_batching": {
                "default_queue_policy": {"allow_timeout_override": True, "timeout_action": "DELAY"}
            }
        },
        {"sequence_batching": {"max_sequence_idle_microseconds": "1000000"}},
        {"model_transaction_policy": {"decoupled": True}},
    ):
        assert limit_from_triton({**config, **ordered}) == 0, ordered
    for rejecting in (  # the window fails them itself when their timeout passes
        {"default_timeout_microseconds": "5"},
        {"allow_timeout_override": True, "timeout_action": "REJECT"},
    ):
        queued = {"dynamic_batching": {"default_queue_policy": rejecting}}
        assert limit_from_triton({**config, **queued}) == 48, rejecting


def test_a_request_whose_queue_timeout_passes_while_it_waits_fails_unsent():
    """Its timeout (the policy's, or its own where the policy allows one) runs from its
    arrival: it fails with ``DeadlineExceeded`` unsent, is counted, and the next one
    that waits goes in its place; a client leaving after that changes nothing."""

    async def main():
        queue = QueuePolicy(default_timeout_us=10_000_000, allow_timeout_override=True)
        w = Window("m", 1, queue=queue)
        answers: list = []
        first = w.send(lambda finish: None, answers.append, None)  # with tritonserver
        assert first is not None
        sent: list[str] = []
        late = w.send(lambda finish: sent.append("late"), answers.append, None, 20_000)
        patient = asyncio.ensure_future(w.wait())  # the policy's 10 s
        await asyncio.sleep(0.2)
        assert len(answers) == 1 and isinstance(answers[0], DeadlineExceeded), answers
        assert "20000 us" in str(answers[0]) and not sent
        assert (w.timed_out, w.queued, w.abandoned_queued) == (1, 1, 0)
        assert late is not None
        late()  # its client leaves after it was answered: nothing more
        assert w.abandoned_queued == 0
        w.done(first.args[0])
        slot = await asyncio.wait_for(patient, 1)
        assert w.sent == 1 and w.queued == 0 and not sent
        w.done(slot)
        held = await w.wait()
        with pytest.raises(DeadlineExceeded):  # the coroutine path: raised to its caller
            await w.wait(timeout_us=20_000)
        assert (w.timed_out, w.queued, w.sent) == (2, 0, 1)
        w.done(held)

    asyncio.run(main())
