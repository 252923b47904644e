"""servekit compare: same load against each runtime, a report that names what it skipped."""

from __future__ import annotations

import pytest

from servekit import ModelConfig
from servekit.bench import MeasureConfig
from servekit.bench.compare import compare
from servekit.bench.compare_report import markdown_report

FAST = MeasureConfig(window_s=0.3, warmup_s=0.1, max_windows=3, stability=1.0)


def test_compare_interleaves_rounds_and_reports_verdicts_policies_and_time(tiny_cnn_path):
    events: list[str] = []
    result = compare(
        ModelConfig(str(tiny_cnn_path), instances=1),
        ["raw", "batcher", "native"],
        [1, 2],
        FAST,
        on_event=events.append,
        ceiling_seconds=0.2,
        rounds=2,
    )
    measured = [e for e in events if e.startswith("round ")]
    assert measured == [  # every runtime in each round, each round one runtime later
        "round 1/2: measuring raw", "round 1/2: measuring batcher", "round 1/2: measuring native",
        "round 2/2: measuring batcher", "round 2/2: measuring native", "round 2/2: measuring raw",
    ]  # fmt: skip
    assert list(result.rounds) == ["raw", "batcher", "native"]
    assert all(len(r) == 2 for r in result.rounds.values())
    assert result.ceiling and set(result.ceiling_by_batch) == {1, 8, 16, 64}  # and the max
    for points in result.series.values():
        assert [p.level for p in points] == [1, 2]
        for p in points:
            assert p.stats.errors == 0 and p.stats.requests > 0, p.stats.error_messages
    shares = result.share_of_raw()
    best_raw = max(p.stats.inferences_per_s for p in result.series["raw"])
    assert shares["raw"] == pytest.approx(best_raw / result.ceiling)
    assert "1 instance(s)" in result.policies["native"] and "no batching" in result.policies["raw"]
    # The model's own statistics: the batcher's counters, native's /stats; native's CPU.
    for name in ("batcher", "native"):
        assert result.time_spent[name]["compute"] > 0 and result.time_spent[name]["queue"] >= 0
    assert any(k.startswith("CPU: ") for k in result.time_spent["native"])
    result.skipped["ray"] = "ray is not installed"
    report = markdown_report(
        result, "servekit compare --runtimes raw,batcher,ray", "compare.png", "test box", "c 1,2"
    )
    assert f"# servekit compare: {result.model}" in report and "Machine: test box." in report
    assert "| raw | 1 |" in report and "| batcher | 2 |" in report and "Raw ceiling:" in report
    assert report.count("- server CPU per request (us): ") == 2  # a verdict per level
    assert report.count("- throughput (rows/s): ") == 2 and " ± " in report
    assert "## Where the time goes" in report and "nan" not in report.lower()
    assert "Skipped: ray (ray is not installed)" in report


def test_without_raw_no_share_is_printed_and_nothing_is_nan(add_sub_path):
    result = compare(ModelConfig(str(add_sub_path)), ["batcher"], [1], FAST)
    assert result.share_of_raw() == {}
    report = markdown_report(result, "servekit compare", None, "test box")
    assert "nan" not in report.lower() and "share" not in report
    assert "one round: no interval, no verdict" in report or "fewer than two" in report


def test_a_budget_the_triton_runtimes_cannot_adapt_is_said_in_the_policy_notes(add_sub_path):
    from servekit import BatchingPolicy
    from servekit.bench.compare import Setup, effective_policy

    model = ModelConfig(
        str(add_sub_path), batching=BatchingPolicy(max_batch_size=16, latency_budget_ms=5)
    )
    setup = Setup.of(model)
    text, notes = effective_policy(setup, "native")
    assert "max_batch_size 16" in text and "latency budget 5 ms" in text and notes == []
    _, notes = effective_policy(setup, "pytriton")
    assert "served as a fixed max_queue_delay_us = 500" in notes[0]


def test_the_compare_command_keeps_a_config_file_s_policy(add_sub_path, tmp_path):
    from typer.testing import CliRunner

    from servekit.cli import app

    config = tmp_path / "serve.toml"
    config.write_text(
        f'[[models]]\nsource = "{add_sub_path}"\ninstances = 1\nthreads = 1\n'
        "[models.batching]\nmax_batch_size = 16\nmax_queue_delay_us = 300\n"
    )
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, [
        "compare", "--config", str(config), "--runtimes", "batcher,raw", "--concurrency", "1",
        "--window", "0.3", "--warmup", "0.1", "--max-windows", "3", "--rounds", "2",
        "--ceiling-seconds", "0", "--out", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = out.with_suffix(".md").read_text()
    assert "| batcher | max_batch_size 16, max_queue_delay_us 300, 1 instance(s)" in report
    assert "add_sub" in report and "closed loop at concurrency 1 over grpc" in report
    assert "nan" not in report.lower() and "throughput (rows/s): " in result.output


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
