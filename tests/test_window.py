"""The one sliding window every figure uses (metrics' summaries, the autoscaling signal):
what it keeps at any time is exactly what a list filtered by time keeps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from servekit.window import SlidingWindow, percentiles

TIMES = st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40).map(sorted)


@given(times=TIMES, window_s=st.floats(0.1, 5), later=st.floats(0, 5))
def test_a_window_keeps_what_was_added_within_window_s(times, window_s, later):
    window: SlidingWindow[int] = SlidingWindow(window_s)
    for i, t in enumerate(times):
        window.add(t, i)
    now = times[-1] + later
    assert window.items(now) == [i for i, t in enumerate(times) if t >= now - window_s]


@given(times=TIMES, window_s=st.floats(0.1, 5), later=st.floats(0, 5))
def test_a_window_of_readings_keeps_the_last_one_before_it_as_the_base(times, window_s, later):
    window: SlidingWindow[int] = SlidingWindow(window_s, keep_base=True)
    for i, t in enumerate(times):
        window.add(t, i)
    now = times[-1] + later
    before = [i for i, t in enumerate(times) if t <= now - window_s]
    # From the last reading at or before the window's start (two readings at least).
    first = min(before[-1] if before else 0, max(len(times) - 2, 0))
    assert window.items(now) == list(range(first, len(times)))


@given(values=st.lists(st.integers(0, 1000), min_size=1, max_size=200))
def test_percentiles_are_observed_values_with_p_percent_at_or_below(values):
    for p, got in zip((50, 90, 99, 100), percentiles(values, (50, 90, 99, 100)), strict=True):
        assert got in values
        assert sum(v <= got for v in values) >= p / 100 * len(values)
        assert sum(v < got for v in values) < p / 100 * len(values) or p == 0
