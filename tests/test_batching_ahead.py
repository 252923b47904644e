"""``batching.ahead``: when a batch may leave while the devices behind the batcher are busy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit.batching.ahead import MARGIN_S, Ahead


def test_with_a_device_idle_or_a_full_batch_it_leaves_at_once():
    ahead = Ahead(limit=8, devices=2)
    assert ahead.may_leave(1, 0.0) == 0.0
    ahead.sent(1, 0.0)
    assert ahead.may_leave(1, 0.0) == 0.0  # the second device is idle
    ahead.sent(1, 0.0)
    assert ahead.may_leave(8, 0.0) == 0.0
    assert ahead.may_leave(7, 0.0) is None  # nothing learned: wait for one to come back


def test_a_partial_batch_leaves_the_round_trip_s_off_device_part_before_the_one_out_returns():
    ahead = Ahead(limit=32)
    ahead.sent(1, 0.0)
    ahead.back(0.010)  # the shortest round trip: at most 10 ms off the device
    ahead.sent(16, 1.0)
    ahead.back(1.050)
    ahead.sent(16, 2.0)
    assert ahead.expected_back() == pytest.approx(2.050)
    assert ahead.may_leave(4, 2.0) == pytest.approx(0.050 - 0.010 - MARGIN_S)
    assert ahead.may_leave(4, 2.037) > 0.0
    assert ahead.may_leave(4, 2.038) == 0.0
    ahead.sent(4, 2.038)  # behind the one running: it starts once that one is done
    assert ahead.may_leave(4, 2.039) is None
    ahead.back(2.050)
    # Unlearned at 4 rows: the nearest larger size bounds it, counted from the return
    # before it less the part off the device.
    assert ahead.expected_back() == pytest.approx(2.050 + 0.050 - 0.010)


def test_devices_are_counted():
    with pytest.raises(ValueError, match="devices"):
        Ahead(limit=4, devices=0)


@given(
    st.lists(st.tuples(st.integers(1, 31), st.floats(1e-4, 0.2)), min_size=1, max_size=30),
    st.integers(1, 3),
)
def test_with_every_device_busy_only_a_partial_batch_waits_and_never_past_a_round_trip(
    trips, devices
):
    """Every device keeps a batch out throughout: a full batch always leaves, a partial
    one waits for a batch to come back or at most one learned round trip, and a device
    that frees takes the next batch at once."""
    ahead, now, left = Ahead(limit=32, devices=devices), 0.0, []
    for _ in range(devices):
        ahead.sent(1, now)
        left.append(now)
    longest = 0.0
    for rows, took in trips:
        assert ahead.may_leave(32, now) == 0.0
        wait = ahead.may_leave(rows, now)
        assert wait is None or 0.0 <= wait <= longest, (wait, longest)
        now += took
        ahead.back(now)
        longest = max(longest, now - left.pop(0))
        assert ahead.may_leave(rows, now) == 0.0
        ahead.sent(rows, now)
        left.append(now)
