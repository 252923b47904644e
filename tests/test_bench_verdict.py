"""Verdicts on a figure measured in rounds: a winner only beyond noise (Welch's 95 %
interval on the best two's difference), intervals from Student's t, no NaN."""

from __future__ import annotations

import math

import pytest

from servekit.bench.verdict import interval, judge, t95


def test_an_interval_is_students_and_one_round_has_none():
    i = interval([10.0, 12.0, 14.0])
    assert i.mean == 12 and i.half == pytest.approx(4.303 * 2 / math.sqrt(3))
    assert i.text() == "12 ± 5"
    one = interval([7.0, math.nan])
    assert one.n == 1 and one.text(1) == "7.0" and interval([]).text() == "-"
    assert t95(1) == 12.706 and t95(100) == 1.96 and t95(0) == math.inf


def test_a_lead_beyond_noise_names_the_winner():
    v = judge("server CPU per request (us)", {"native": [360, 365, 358], "pytriton":
              [900, 910, 890], "triton": [1500, 1490, 1510]}, higher_is_better=False)  # fmt: skip
    assert v.winner == "native" and v.runner_up == "pytriton" and v.beyond_noise
    assert "**native** wins" in v.text and "beyond noise" in v.text


def test_a_lead_within_the_spread_is_within_noise():
    v = judge("throughput (rows/s)", {"native": [1161, 1636, 1400], "pytriton":
              [1300, 1250, 1500]}, higher_is_better=True)  # fmt: skip
    assert v.leader == "native" and v.winner is None and not v.beyond_noise
    assert "within noise" in v.text and "no winner" in v.text


def test_one_round_or_one_runtime_gives_no_verdict_and_no_nan():
    v = judge("p99 latency (ms)", {"a": [1.0], "b": [2.0]}, higher_is_better=False)
    assert v.leader == "a" and v.winner is None and "give --rounds 2" in v.text
    lone = judge("p99 latency (ms)", {"a": [1.0, 2.0], "b": [math.nan]}, False)
    assert lone.winner is None and "fewer than two" in lone.text
    assert "nan" not in (v.text + lone.text).lower()
