"""Statistics: nearest-rank percentiles, window summaries, perf_analyzer's stability rule."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit.bench import (
    MeasureConfig,
    WindowStats,
    is_stable,
    parse_levels,
    percentile,
    rows_per_s,
    summarize,
)


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=500), st.floats(0, 100))
def test_percentile_is_numpys_inverted_cdf(values, p):
    values = sorted(values)
    assert percentile(values, p) == pytest.approx(
        float(np.percentile(values, p, method="inverted_cdf"))
    )


def test_percentiles_of_a_known_uniform_sample():
    values = list(range(1, 101))
    assert [percentile(values, p) for p in (50, 90, 95, 99, 100)] == [50, 90, 95, 99, 100]
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="got 101"):
        percentile(values, 101)


def test_summary_of_an_exponential_sample_recovers_its_quantiles():
    rng = np.random.default_rng(0)
    lat = rng.exponential(0.010, 200_000)  # mean 10 ms
    s = summarize(lat.tolist(), errors=3, duration_s=100.0, rows_per_request=4)
    assert s.requests == 200_000 and s.errors == 3 and s.inferences == 800_000
    assert s.throughput == pytest.approx(2000) and s.inferences_per_s == pytest.approx(8000)
    assert s.mean_ms == pytest.approx(10, rel=0.01)
    assert s.p50_ms == pytest.approx(10 * math.log(2), rel=0.02)
    assert s.p99_ms == pytest.approx(10 * math.log(100), rel=0.03)


def window(throughput: float, p95: float) -> WindowStats:
    return WindowStats(int(throughput), 0, 1.0, int(throughput), p95, p95, p95, p95, p95)


def test_stability_needs_three_windows_agreeing_on_throughput_and_p95():
    steady = [window(100, 10), window(104, 10.5), window(97, 9.8)]
    assert is_stable(steady)
    assert not is_stable(steady[:2])
    assert not is_stable([*steady[:2], window(130, 10)])  # throughput drifts
    assert not is_stable([*steady[:2], window(100, 14)])  # latency drifts
    assert is_stable([window(50, 99), *steady])  # only the last three count
    assert not is_stable([window(0, math.nan)] * 3)


def test_level_ranges():
    assert parse_levels("1:16:2") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert parse_levels("1:16:x2") == [1, 2, 4, 8, 16]
    assert parse_levels("50:200:50") == [50, 100, 150, 200]
    assert parse_levels("1,2,4") == [1, 2, 4]
    assert parse_levels("2.5") == [2.5]
    for bad in ("1:16:0", "a:b", "1:16:x1", "0,1", "1:2:3:4", "nan", "inf", "1,nan"):
        with pytest.raises(ValueError, match="bad range"):
            parse_levels(bad)
    with pytest.raises(ValueError, match="'5:1:1': its start is past its end"):
        parse_levels("5:1:1")


@pytest.mark.parametrize(
    "knobs",
    [
        {"window_s": math.nan},
        {"warmup_s": math.nan},
        {"window_s": math.inf},
        {"stability": math.nan},
        {"timeout_ms": math.nan},
        {"timeout_ms": math.inf},
    ],
)
def test_a_window_that_would_never_end_is_refused(knobs):
    """``--window nan`` measured forever: no clock reading reaches NaN seconds."""
    with pytest.raises(ValueError, match="nan|inf"):
        MeasureConfig(**knobs)


def test_a_deadline_that_has_passed_or_negative_retries_are_refused():
    with pytest.raises(ValueError, match="timeout_ms must be a positive number of ms, got 0"):
        MeasureConfig(timeout_ms=0)
    with pytest.raises(ValueError, match="retries must be >= 0, got -1"):
        MeasureConfig(retries=-1)


def test_rows_per_s_counts_rows_of_back_to_back_calls_after_the_warmup():
    calls = []

    def call():
        calls.append(1)
        time.sleep(0.01)

    start = time.perf_counter()
    rate = rows_per_s(call, rows=4, seconds=0.2, warmup=3)
    total = time.perf_counter() - start
    timed = len(calls) - 3
    assert timed >= 10
    # The rate is the timed calls' rows over the timed loop (the total less the warm-up).
    assert rate == pytest.approx(4 * timed / (total - 0.03), rel=0.3)
