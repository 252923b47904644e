"""The batching decision and the queue policy, with a fake clock: no threads, no sleeps."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit import BatchingPolicy, DeadlineExceeded, Overloaded, QueuePolicy, TimeoutAction
from servekit.batching import decide
from servekit.batching.queue import RequestQueue
from servekit.batching.request import Request


class FakeFuture:
    """Stands in for a caller's future: done once resolved, failed or cancelled."""

    def __init__(self) -> None:
        self.result = self.exception = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True

    def set_result(self, value) -> None:
        self.result, self._done = value, True

    def set_exception(self, exc) -> None:
        self.exception, self._done = exc, True


def req(
    i: int, rows: int = 1, arrival: float = 0.0, shape=((4,),), level: int = 1, deadline=math.inf
) -> Request:
    return Request(i, {}, rows, shape, level, arrival, deadline, FakeFuture())  # type: ignore[arg-type]


# ----------------------------------------------------------------- decide

requests_st = st.lists(
    st.tuples(st.integers(1, 8), st.floats(0, 1), st.sampled_from([((4,),), ((5,),)])),
    min_size=1,
    max_size=40,
)
policy_st = st.tuples(
    st.integers(1, 32),  # limit
    st.lists(st.integers(1, 32), max_size=3),  # preferred (clipped to limit below)
    st.sampled_from([0.0, 0.001, 0.01]),  # delay
)


@given(requests_st, policy_st, st.floats(0, 2))
def test_a_batch_never_exceeds_the_limit_unless_one_request_is_larger(raw, pol, now):
    limit, preferred, delay = pol
    preferred = sorted({p for p in preferred if p <= limit})
    pending = [req(i, r, a, s) for i, (r, a, s) in enumerate(raw)]
    d = decide(pending, now, limit=max([limit, *preferred]), preferred=preferred, delay_s=delay)
    if d.take:
        rows = sum(r.rows for r in pending[: d.take])
        assert rows <= limit or d.take == 1
        assert len({r.shape_key for r in pending[: d.take]}) == 1


@given(requests_st, policy_st, st.floats(0, 2))
def test_nothing_waits_past_the_delay_once_the_oldest_has_waited_it(raw, pol, now):
    limit, _, delay = pol
    pending = [req(i, r, a, s) for i, (r, a, s) in enumerate(raw)]
    d = decide(pending, now, limit=limit, delay_s=delay)
    oldest = min(r.arrival for r in pending)
    if delay == 0 or now - oldest >= delay:
        assert d.take >= 1
    else:
        assert d.take >= 1 or d.wait_s == pytest.approx(delay - (now - oldest))


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=30),
    st.lists(st.integers(1, 16), min_size=1, max_size=3),
)
def test_the_largest_reachable_preferred_size_is_sent_at_once(rows, preferred):
    preferred = sorted(set(preferred))
    pending = [req(i, r) for i, r in enumerate(rows)]
    limit = preferred[-1]
    d = decide(pending, 0.0, limit=limit, preferred=preferred, delay_s=1.0)
    prefix, reachable = 0, []
    for r in rows:
        prefix += r
        if prefix > limit:
            break
        if prefix in preferred:
            reachable.append(prefix)
    if reachable:
        assert sum(rows[: d.take]) == max(reachable)


def test_with_a_delay_and_no_preferred_size_it_waits_for_more():
    pending = [req(0, 3, arrival=10.0)]
    d = decide(pending, 10.0004, limit=8, delay_s=0.001)
    assert d.take == 0 and d.wait_s == pytest.approx(0.0006)
    assert decide(pending, 10.001, limit=8, delay_s=0.001).take == 1


def test_a_full_batch_or_a_shape_change_is_sent_without_waiting():
    full = [req(i, 4) for i in range(3)]
    assert decide(full, 0.0, limit=8, delay_s=10).take == 2
    mixed = [req(0, 1), req(1, 1, shape=((5,),))]
    assert decide(mixed, 0.0, limit=8, delay_s=10).take == 1


def test_flush_sends_everything_regardless_of_delay():
    assert decide([req(0), req(1)], 0.0, limit=8, delay_s=10, flush=True).take == 2


def test_an_oversized_first_request_still_runs_alone():
    assert decide([req(0, 9), req(1, 1)], 0.0, limit=8, preferred=[4, 8]).take == 1


# ------------------------------------------------------------------ queue


def test_full_queue_rejects_at_once():
    q = RequestQueue(BatchingPolicy(default_queue_policy=QueuePolicy(max_queue_size=2)))
    q.push(req(0))
    q.push(req(1))
    with pytest.raises(Overloaded, match=r"2 requests waiting.*max_queue_size 2"):
        q.push(req(2))


def test_cancelled_requests_free_their_queue_slot():
    q = RequestQueue(BatchingPolicy(default_queue_policy=QueuePolicy(max_queue_size=1)))
    first = req(0)
    q.push(first)
    first.future.cancel()
    q.push(req(1))
    assert [r.id for r in q.peek(10)] == [1]


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3)), max_size=30))
def test_walk_order_is_priority_then_arrival(items):
    policy = BatchingPolicy(priority_levels=3, default_priority_level=2)
    q = RequestQueue(policy)
    for i, (level, _) in enumerate(items):
        q.push(req(i, level=level))
    walked = q.peek(100)
    assert [(r.level, r.id) for r in walked] == sorted((r.level, r.id) for r in walked)
    assert len(walked) == len(items)


def test_reject_fails_timed_out_requests_without_running_them():
    q = RequestQueue(BatchingPolicy(default_queue_policy=QueuePolicy(default_timeout_us=1000)))
    late, fine = req(0, deadline=0.001), req(1, deadline=5.0)
    q.push(late)
    q.push(fine)
    assert q.next_deadline() == 0.001
    assert q.expire(0.002) == 1
    assert isinstance(late.future.exception, DeadlineExceeded)
    assert [r.id for r in q.peek(10)] == [1]
    assert q.next_deadline() == 5.0


def test_delay_moves_timed_out_requests_behind_unexpired_ones_of_their_level():
    policy = BatchingPolicy(
        priority_levels=2,
        default_priority_level=1,
        default_queue_policy=QueuePolicy(
            default_timeout_us=1000, timeout_action=TimeoutAction.DELAY
        ),
    )
    q = RequestQueue(policy)
    for r in (req(0, deadline=0.001), req(1), req(2, level=2), req(3, deadline=0.001)):
        q.push(r)
    assert q.expire(0.002) == 0  # nothing failed
    assert [r.id for r in q.peek(10)] == [1, 0, 3, 2]  # level 1 live, level 1 delayed, level 2


def test_take_removes_a_prefix_and_skips_dropped_requests():
    q = RequestQueue(BatchingPolicy())
    rs = [req(i) for i in range(5)]
    for r in rs:
        q.push(r)
    rs[1].future.cancel()
    batch = q.peek(2)
    assert [r.id for r in batch] == [0, 2]
    q.take(batch)
    assert [r.id for r in q.peek(10)] == [3, 4]
    assert len(q) == 2


def test_requests_hold_real_futures_too():
    loop = asyncio.new_event_loop()
    try:
        r = Request(0, {}, 1, (), 1, 0.0, math.inf, loop.create_future())
        r.future.cancel()
        r.resolve({"y": 1})  # a cancelled caller stays cancelled
        assert r.future.cancelled()
    finally:
        loop.close()
