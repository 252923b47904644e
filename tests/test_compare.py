"""servekit compare: same load against each runtime, a report that names what it skipped."""

from __future__ import annotations

import pytest

from servekit.bench import MeasureConfig
from servekit.bench.compare import compare, markdown_report

FAST = MeasureConfig(window_s=0.3, warmup_s=0.1, max_windows=3, stability=1.0)


def test_compare_runs_each_runtime_and_reports_shares_of_raw(tiny_cnn_path):
    events: list[str] = []
    result = compare(tiny_cnn_path, ["raw", "batcher", "ray"], [1, 2], FAST, on_event=events.append)
    assert list(result.series) == ["raw", "batcher"]
    assert "ray" in result.skipped and "ray" in result.skipped["ray"].lower()
    for points in result.series.values():
        assert [p.level for p in points] == [1, 2]
        assert all(p.stats.errors == 0 and p.stats.requests > 0 for p in points)
    shares = result.share_of_raw()
    assert shares["raw"] == 1.0 and shares["batcher"] > 0
    report = markdown_report(
        result, "servekit compare --runtimes raw,batcher,ray", "compare.png", "test box"
    )
    assert "| raw | 1 |" in report and "| batcher | 2 |" in report
    assert "Skipped: ray (" in report and "servekit compare --runtimes raw,batcher,ray" in report
    assert any("skipped ray" in e for e in events)


def test_unknown_runtimes_are_named(tiny_cnn_path):
    with pytest.raises(ValueError, match=r"unknown runtime\(s\) \['tfserving'\]"):
        compare(tiny_cnn_path, ["raw", "tfserving"], [1], FAST)
