"""The simulated accelerator: batch times follow the device profile, one batch at a time."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from conftest import each_client
from servekit import FunctionRunner, ModelConfig, ModelSpec, ServeConfig, TensorSpec, zoo
from servekit.runners import load_runner
from servekit.runners.simulated import DeviceProfile, SimulatedDevice
from servekit.zoo.tiny import SIM_T4


@pytest.fixture(scope="module")
def sim_path(model_cache):
    return zoo.build("sim_t4", model_cache)


def test_a_file_with_a_device_profile_runs_on_the_simulated_device(sim_path):
    runner = load_runner(sim_path)
    try:
        assert isinstance(runner, SimulatedDevice)
        fixed, per_row = SIM_T4
        assert runner.profile == DeviceProfile("t4-int8-x8", fixed * 8, per_row * 8)
        assert runner.profile.ceiling(32) == pytest.approx(32 / (0.008 + 32 * 0.0016))
        out = runner.infer({"input": np.zeros((3, 64, 64, 3), np.float32)})
        assert out["logits"].shape == (3, 1000) and out["logits"].dtype == np.float32
    finally:
        runner.close()


def test_a_batch_takes_at_least_the_profiles_time(sim_path):
    runner = load_runner(sim_path)
    try:
        for rows in (1, 8):
            start = time.perf_counter()
            runner.infer({"input": np.zeros((rows, 64, 64, 3), np.float32)})
            assert time.perf_counter() - start >= runner.profile.batch_s(rows)
    finally:
        runner.close()


def test_batches_from_several_runners_share_one_device(sim_path):
    """Two instances (as Triton's would be) never compute at the same time."""
    runners = [load_runner(sim_path) for _ in range(2)]
    x = {"input": np.zeros((4, 64, 64, 3), np.float32)}
    start = time.perf_counter()
    threads = [threading.Thread(target=r.infer, args=(x,)) for r in runners for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - start >= 4 * runners[0].profile.batch_s(4)
    for r in runners:
        r.close()


def test_a_runtime_serves_it_through_load_runner(sim_path):
    """Served (native, over gRPC), a batch still takes at least the device's time."""
    from servekit import Client
    from servekit.native import NativeServer

    config = ServeConfig((ModelConfig(str(sim_path)),), runtime="native").on_loopback()
    with NativeServer(config) as server, Client(config.server.grpc_url) as c:
        runner = next(iter(server.models)).runner.runner
        assert isinstance(runner, SimulatedDevice)
        start = time.perf_counter()
        out = c.infer("sim_t4", {"input": np.ones((2, 64, 64, 3), np.float32)})
        assert time.perf_counter() - start >= runner.profile.batch_s(2)
        assert out["logits"].shape == (2, 1000)


def test_it_is_served_as_a_tensor_model(sim_path):
    from servekit.pipeline import is_image_classifier

    runner = load_runner(sim_path)
    assert not is_image_classifier(runner.spec)
    runner.close()


def test_the_device_records_its_timeline_and_shows_overlapped_hand_overs(
    sim_path, tmp_path, monkeypatch
):
    """With ``SERVEKIT_DEVICE_TIMELINE`` set, each batch is a line (handed, taken, let go,
    rows): one caller at a time leaves the device idle between batches, nothing waiting;
    two runners (two instances) keep a batch waiting while the other runs."""
    from servekit.bench.timeline import read, summarize
    from servekit.runners.simulated import TIMELINE_ENV

    x = {"input": np.zeros((4, 64, 64, 3), np.float32)}
    one = tmp_path / "one.jsonl"
    monkeypatch.setenv(TIMELINE_ENV, str(one))
    runner = load_runner(sim_path)
    try:
        for _ in range(10):
            runner.infer(x)
            time.sleep(0.005)  # the host's work between batches: the device waits
    finally:
        runner.close()
    batches = read(one)
    assert len(batches) == 10 and {b.rows for b in batches} == {4}
    assert all(b.handed <= b.start < b.end for b in batches)
    alone = summarize(batches, trim=0.0)
    assert alone.overlapped_share == 0 and alone.idle_gap_ms >= 5
    assert alone.busy_share < 0.9

    two = tmp_path / "two.jsonl"
    monkeypatch.setenv(TIMELINE_ENV, str(two))
    runners = [load_runner(sim_path) for _ in range(2)]

    def work(r) -> None:
        for _ in range(5):
            r.infer(x)
            time.sleep(0.005)

    threads = [threading.Thread(target=work, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in runners:
        r.close()
    overlapped = summarize(read(two), trim=0.0)
    assert overlapped.overlapped_share > 0.5 and overlapped.busy_share > alone.busy_share


def test_a_queued_device_runs_batches_handed_over_while_busy_back_to_back(tmp_path, monkeypatch):
    """As a CUDA stream: the next batch starts where the last ends, never overlapping it,
    with no gap for a host thread to wake (the timeline's start and end are the device's)."""
    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("SERVEKIT_DEVICE_TIMELINE", str(timeline))
    spec = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [3]),), 8)
    profile = DeviceProfile(f"queued-{time.time_ns()}", 20_000.0, 0.0, queued=True)
    runners = [SimulatedDevice(FunctionRunner(lambda i: i, spec), profile) for _ in range(3)]
    x = {"x": np.zeros((2, 2), np.float32)}
    outs: list = []
    start = time.time()
    each_client(lambda k: outs.append(runners[k].infer(x)), clients=3)  # names a failure
    for r in runners:
        r.close()
    assert [o["y"].shape for o in outs] == [(2, 3)] * 3
    lines = timeline.read_text().splitlines()
    runs = sorted((line["start"], line["end"]) for line in map(json.loads, lines))
    assert len(runs) == 3 and runs[0][0] >= start
    for (_, end), (begin, _) in zip(runs, runs[1:], strict=False):
        assert begin == pytest.approx(end, abs=1e-9)  # back to back, never overlapping
    assert time.time() - start >= 3 * 0.02
