"""servekit compare: same load against each runtime, a report that names what it skipped."""

from __future__ import annotations

import pytest

from servekit import ModelConfig
from servekit.bench import MeasureConfig
from servekit.bench.compare import compare, markdown_report

FAST = MeasureConfig(window_s=0.3, warmup_s=0.1, max_windows=3, stability=1.0)


def test_compare_runs_each_runtime_and_reports_shares_of_raw(tiny_cnn_path):
    events: list[str] = []
    result = compare(
        ModelConfig(str(tiny_cnn_path)),
        ["raw", "batcher", "native"],
        [1, 2],
        FAST,
        on_event=events.append,
        ceiling_seconds=0.2,
    )
    assert list(result.series) == ["raw", "batcher", "native"]
    assert result.ceiling and set(result.ceiling_by_batch) == {1, 8, 16, 64}  # and the max
    for points in result.series.values():
        assert [p.level for p in points] == [1, 2]
        assert all(p.stats.errors == 0 and p.stats.requests > 0 for p in points)
    shares = result.share_of_raw()
    best_raw = max(p.stats.inferences_per_s for p in result.series["raw"])
    assert shares["raw"] == pytest.approx(best_raw / result.ceiling)
    assert shares["batcher"] > 0 and shares["native"] > 0
    result.skipped["ray"] = "ray is not installed"
    report = markdown_report(
        result, "servekit compare --runtimes raw,batcher,ray", "compare.png", "test box"
    )
    assert "| raw | 1 |" in report and "| batcher | 2 |" in report and "Raw ceiling:" in report
    assert "Skipped: ray (ray is not installed)" in report
    assert "servekit compare --runtimes raw,batcher,ray" in report
    assert any("raw ceiling" in e for e in events)


def test_unavailable_runtimes_are_skipped_with_the_reason(tiny_cnn_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    result = compare(ModelConfig(str(tiny_cnn_path)), ["ray"], [1], FAST)
    assert result.series == {} and "pip install 'servekit[ray]'" in result.skipped["ray"]


def test_unknown_runtimes_are_named(tiny_cnn_path):
    with pytest.raises(ValueError, match=r"unknown runtime\(s\) \['tfserving'\]"):
        compare(ModelConfig(str(tiny_cnn_path)), ["raw", "tfserving"], [1], FAST)


@pytest.mark.parametrize("protocol", ["http-json", "http-binary", "grpc"])
def test_compare_reaches_a_served_runtime_over_each_protocol(add_sub_path, protocol, monkeypatch):
    from servekit.bench import compare as module
    from servekit.endpoints import free_port

    first = free_port()
    started = []
    enter = module.ServerProcess.__enter__

    def recorded(self):
        started.append(self.config.server)
        return enter(self)

    monkeypatch.setattr(module.ServerProcess, "__enter__", recorded)
    result = compare(
        ModelConfig(str(add_sub_path)), ["native"], [2], FAST, protocol=protocol,
        ports=(first, first + 20),
    )  # fmt: skip
    (server,) = started  # every port of the served runtime within the range given
    assert all(first <= p <= first + 20 for p in (server.http_port, server.grpc_port,
                                                   server.metrics_port))  # fmt: skip
    (point,) = result.series["native"]
    assert point.stats.errors == 0 and point.stats.requests > 0
    assert point.server_cpu_us > 0 and point.client_cpu_us > 0
    over = {"grpc": "over gRPC", "http-binary": "binary tensors", "http-json": "JSON tensors"}
    assert over[protocol] in result.workload


def test_an_unknown_protocol_is_named(add_sub_path):
    with pytest.raises(ValueError, match="unknown protocol 'http2'"):
        compare(ModelConfig(str(add_sub_path)), ["native"], [1], FAST, protocol="http2")
