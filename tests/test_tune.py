"""``servekit tune`` against real servers: a simulated device whose batch time is known
(20 ms + 2 ms a row, sleeping without the GIL) has a known best configuration, which
brute and quick both find; constraints prune; a candidate that cannot start is reported;
Ctrl-C stops the server and writes the report; best.toml is served as written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import free_port, wait_until
from servekit.batching import BatchingPolicy
from servekit.bench.cpu import descendants
from servekit.bench.loadgen import MeasureConfig
from servekit.config import ModelConfig, ServeConfig
from servekit.protocol.pbtxt import parse
from servekit.tune import Constraints, Measurement, SearchSpace, tune, write_outputs
from servekit.zoo.tiny import build_simulated

SERVEKIT = [sys.executable, "-m", "servekit"]
QUICK_WINDOWS = MeasureConfig(window_s=0.6, warmup_s=0.3, max_windows=4)


@pytest.fixture(scope="module")
def device(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "simdev.onnx"
    onnx.save(build_simulated(f"tune-test-{os.getpid()}", 20_000, 2_000, max_rows=64), path)
    return path


def test_brute_and_quick_find_the_known_best_and_constraints_prune(device, tmp_path):
    """Batch time 20 ms + 2 ms/row: batch 1 tops out near 45 rows/s, batch 4 near 140,
    batch 16 near 300 (at 16 clients, p99 52-80 ms); batch 128 does not fit the device's
    memory (64 rows), so that server refuses to start."""
    base = ServeConfig((ModelConfig(str(device), batching=BatchingPolicy(16)),), runtime="native")
    space = SearchSpace((1, 4, 16, 128), (1,), (0, 2000), (None,))
    constraints = Constraints(p99_ms=150, min_throughput=60)
    how = Measurement((16,), QUICK_WINDOWS)  # sixteen clients decide each verdict here

    every = tune(base, space, constraints, how, search="brute", baseline=False)
    assert len(every.trials) == space.size == 8
    by = {(t.knobs.max_batch_size, t.knobs.max_queue_delay_us): t for t in every.trials}
    for delay in (0, 2000):
        assert by[1, delay].status == "pruned"
        assert "< 60/s" in by[1, delay].reason
        assert by[128, delay].status == "failed"
        assert "max_batch_size 128 does not fit device" in by[128, delay].reason
        assert by[16, delay].status == "ok"
    for t in every.trials:
        if t.best is not None:
            assert t.best.stats.p99_ms <= 150 and t.best.stats.inferences_per_s >= 60
            assert t.peak_rss_mb > 20
            assert t.best.server_cpu_us > 0
    assert every.best is not None and every.best.knobs.max_batch_size == 16
    best_rate = every.best.best.stats.inferences_per_s  # type: ignore[union-attr]
    assert best_rate > 1.5 * max(
        t.best.stats.inferences_per_s
        for t in every.trials
        if t.best and t.knobs.max_batch_size == 4
    )

    # With a p99 budget, the best candidate's batch and instances are measured once more
    # with the batcher holding that budget itself (latency_budget_ms), for comparison.
    adaptive = every.adaptive
    assert adaptive is not None and adaptive.knobs == every.best.knobs
    assert adaptive.status == "ok", adaptive.reason
    assert adaptive.best.stats.p99_ms <= 150  # type: ignore[union-attr]

    climbed = tune(base, space, constraints, how, search="quick", baseline=False)
    assert climbed.best is not None and climbed.best.knobs.max_batch_size == 16
    assert len(climbed.trials) < len(every.trials)

    written = write_outputs([every], tmp_path, "servekit tune ...", "test machine")
    report = (tmp_path / "report.md").read_text()
    assert "max_batch_size 128 does not fit device" in report and "(Pareto)" in report
    assert "Adaptive batching (`latency_budget_ms = 150`, batch 16, instances 1):" in report
    assert "the best fixed configuration's rows/s" in report
    assert {p.name for p in written} >= {"best.toml", "report.md", "pareto.png", "memory.png"}
    assert ServeConfig.load(tmp_path / "best.toml") == every.best_config()


def _sigint_as_a_terminal_leaves_it() -> None:
    """In the child: SIGINT at its default and unblocked, as an interactive shell starts a
    command. A child inherits an ignored SIGINT, and a suite started as a background job
    without job control (``(pytest &)``) has it ignored: ``servekit tune`` then ran all its
    candidates through the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_stops_the_server_and_writes_the_report_so_far(device, tmp_path):
    command = [
        *SERVEKIT, "tune", "--model", str(device), "--runtime", "native", "--search", "brute",
        "--max-batch-sizes", "4,16", "--instances", "1,2", "--max-queue-delay-us", "0",
        "--concurrency", "1,4", "--window", "1", "--warmup", "0.5", "--max-windows", "3",
        "--no-baseline", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_sigint_as_a_terminal_leaves_it,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("native: batch 4, instances 1"):
                break  # the first candidate is done; the second is starting
        wait_until(
            lambda: [p for p in descendants(proc.pid) if p != proc.pid],
            "the second candidate's server", 60,
        )  # fmt: skip
        servers = [p for p in descendants(proc.pid) if p != proc.pid]
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted" in rest
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Interrupted (Ctrl-C)" in report and "| 1 | batch 4, instances 1" in report
    assert "| 2 |" not in report
    wait_until(
        lambda: not any(Path(f"/proc/{p}").exists() for p in servers),
        f"the candidates' servers {servers} gone", 30,
    )  # fmt: skip


@pytest.mark.ray
def test_tune_all_runtimes_writes_a_best_toml_each_that_serves(add_sub_path, tmp_path):
    out = tmp_path / "out"
    command = [
        *SERVEKIT, "tune", "--model", str(add_sub_path), "--runtime", "all",
        "--max-batch-sizes", "8", "--instances", "1", "--max-queue-delay-us", "100",
        "--overlap", "on",
        "--threads", "1", "--concurrency", "2", "--window", "0.5", "--warmup", "0.3",
        "--max-windows", "3", "--no-baseline", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = (out / "report.md").read_text()
    for runtime in ("native", "pytriton", "triton", "ray"):
        overlap = ", overlap on" if runtime != "native" else ""
        assert f"| {runtime} | batch 8, instances 1, delay 100 us, threads 1{overlap} |" in report
        config = ServeConfig.load(out / runtime / "best.toml")
        (model,) = config.models
        assert config.runtime == runtime
        assert model.batching.max_batch_size == 8 and model.batching.max_queue_delay_us == 100
        assert (model.instances, model.threads) == (1, 1)
    for runtime in ("pytriton", "triton"):
        pbtxt = parse((out / runtime / "config.pbtxt").read_text())
        assert pbtxt.max_batch_size == 8
        assert pbtxt.dynamic_batching.max_queue_delay_microseconds == 100
        assert pbtxt.instance_group[0].count == 1
    assert not (out / "native" / "config.pbtxt").exists()

    # The file as written, on the main job's runtime (ports moved off the defaults).
    from servekit.client import Client

    http, grpc, metrics = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        [*SERVEKIT, "serve", "--config", str(out / "pytriton" / "best.toml"),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(f"http://127.0.0.1:{http}") as client:
                    if client.is_ready("add_sub"):
                        a = np.arange(16, dtype=np.float32)[None]
                        outputs = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
                        np.testing.assert_array_equal(outputs["OUTPUT0"], 2 * a)
                        break
            except (OSError, ConnectionError):
                pass
            except Exception as exc:  # not up yet: the client's own connection errors
                if "onnect" not in str(exc):
                    raise
            assert server.poll() is None and time.monotonic() < deadline, "best.toml did not serve"
            time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
