"""The GPU path right by construction: servekit's own runners, staging, gathers and graph
capture run against a model of CUDA's asynchrony (``fakecuda``), which reports every
access the program did not order, a use after free, pinned memory used after it was
freed, and work on the legacy default stream. Each test names the defect it guards;
each fails if the wait, hold, lock or lease it relies on is taken out of servekit.

Torch's CPU tensors stand for device memory, so these run wherever PyTorch's CPU build
is installed (CI's ``make test``); ``bench/gpu.sh`` runs the same code on a real device
under PyTorch's CUDA sanitizer."""

from __future__ import annotations

import gc
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import needs_torch
from servekit.device import DeviceTensor, gather_on_device
from servekit.spec import ModelSpec, TensorSpec

pytestmark = needs_torch

torch = pytest.importorskip("torch")

from fakecuda import FakeCuda, Race  # noqa: E402  (needs torch)


@pytest.fixture
def fake(fake_cuda):
    return fake_cuda


def on_stream(fake: FakeCuda, rows: np.ndarray, name: str = "producer") -> DeviceTensor:
    """Rows made on a stream of their own (as CUDA shared memory's reads and device
    decode make theirs), written by an asynchronous copy: a reader that does not wait
    for the event reads the old bytes, and the tracker reports it."""
    stream = fake.new_stream(name)
    with fake.using(stream):
        t = torch.empty(rows.shape, dtype=torch.float32)
        t.copy_(torch.from_numpy(rows), non_blocking=True)
    return DeviceTensor(t, np.dtype(np.float32), ready=fake.ready(stream))


def torch_runner(path, **kw):
    from servekit.runners.torch import TorchRunner

    kw.setdefault("precision", "fp32")
    kw.setdefault("max_batch_size", 8)
    return TorchRunner(path, **kw)


@pytest.fixture(scope="module")
def reference(tiny_cnn_path):
    """The tiny CNN on the host: what every device path must answer."""
    runner = torch_runner(tiny_cnn_path, device="cpu", cuda_graphs=False)
    yield lambda x: runner.infer({"input": x})["logits"]
    runner.close()


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


# ---------------------------------------------------------------- 1: stream order


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_lane_waits_for_the_stream_that_made_its_input(fake, tiny_cnn_path, reference, graphs):
    """Defect 1: the lane's copy of an input made on another stream (a decode, a gather)
    comes after that stream made it, not before."""
    runner = torch_runner(tiny_cnn_path, device="cuda", cuda_graphs=graphs)
    try:
        x = images(3)
        got = runner.run({"input": on_stream(fake, x)})["logits"]
        np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)
    finally:
        runner.close()


def test_a_batch_gathered_on_the_device_is_read_after_every_part(fake, tiny_cnn_path, reference):
    """Defect 1: ``gather_on_device`` waits on each request's stream, then hands the lane a
    batch with its own event."""
    runner = torch_runner(tiny_cnn_path, device="cuda")
    try:
        parts = [images(n, seed=n) for n in (1, 2, 3)]
        batch = gather_on_device([on_stream(fake, p, f"request{i}") for i, p in enumerate(parts)])
        assert batch.ready is not None
        got = runner.run({"input": batch})["logits"]
        np.testing.assert_allclose(got, reference(np.concatenate(parts)), rtol=1e-4, atol=1e-5)
    finally:
        runner.close()


def test_an_input_released_while_the_lane_still_copies_it_is_held(fake, tiny_cnn_path):
    """Defect 1: the lane records its use of an input made elsewhere (``record_stream``),
    so the caching allocator does not reuse its block while the lane's copy is queued."""
    runner = torch_runner(tiny_cnn_path, device="cuda")
    try:
        lane = runner._lanes.all[0]
        with fake.using(lane.stream):
            static = torch.empty((3, 3, 32, 32))
            x = lane.upload("input", on_stream(fake, images(3)), None)
            static.copy_(x, non_blocking=True)  # queued on the lane
        del x
        gc.collect()
        fake.check()  # the input's memory is free now: its block is reused at once
        fake.synchronize(lane.stream)
    finally:
        runner.close()


def test_without_waiting_the_fake_device_reports_the_race(fake):
    """The model itself: a read on another stream that did not wait is reported."""
    made = on_stream(fake, images(1))
    reader = fake.new_stream("reader")
    with pytest.raises(Race, match="without waiting"), fake.using(reader):
        made.tensor.sum()
    fake.problems.clear()


def test_eight_clients_through_a_batcher_with_two_lanes_answer_as_the_host(
    fake, tiny_cnn_path, reference
):
    """Defect 1 under load: eight client threads' requests, each made on its own stream,
    batched by a real Batcher over two lanes: every answer is the host's."""
    from servekit import Batcher, BatchingPolicy

    runner = torch_runner(tiny_cnn_path, device="cuda", instances=2)
    batcher = Batcher(runner, BatchingPolicy(max_queue_delay_us=2000), instance_count=2)
    try:

        def client(i: int) -> None:
            for j in range(6):
                x = images(1 + (i + j) % 3, seed=100 * i + j)
                got = batcher.infer_sync({"input": on_stream(fake, x, f"client{i}")})["logits"]
                np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(client, range(8)))
        assert batcher.stats.snapshot().execution_count < 48  # batches formed
    finally:
        batcher.close()
        runner.close()


# ------------------------------------------------- 4: graphs only for fixed shapes


class SumOfRow(torch.nn.Module):
    """[N, L] -> [N, 1] for any length L: a variable non-batch dimension."""

    def forward(self, x):
        return x.sum(dim=1, keepdim=True) * 2


def test_a_variable_non_batch_dimension_serves_eagerly_on_cuda(fake, caplog):
    """Defect 4: graphs were captured with the variable dimension set to 1, and every
    request of another length failed copying into the graph's static input."""
    from servekit.runners.torch import TorchRunner

    spec = ModelSpec((TensorSpec("x", np.float32, [-1]),), (TensorSpec("y", np.float32, [1]),), 8)
    with caplog.at_level(logging.INFO, logger="servekit.runners.torch"):
        runner = TorchRunner(SumOfRow(), spec=spec, device="cuda", precision="fp32")
    try:
        assert runner.graph_sizes == ()
        said = [r.getMessage() for r in caplog.records if "variable dimension" in r.getMessage()]
        assert len(said) == 1 and "'x'" in said[0]
        for length in (1, 5, 17):
            x = np.arange(3 * length, dtype=np.float32).reshape(3, length)
            got = runner.infer({"x": x})["y"]
            np.testing.assert_allclose(got, x.sum(axis=1, keepdims=True) * 2)
    finally:
        runner.close()


# ------------------------------------------------- 6: capture beside serving


def test_a_model_captures_its_graphs_while_another_serves(fake, tiny_cnn_path, reference):
    """Defect 6: capture in torch's default global mode fails (or corrupts the capture)
    when another thread makes a CUDA call meanwhile, as serving models do while the store
    or a live update loads one. Captures run in thread_local mode: the capture here stays
    open until a serving thread's call arrives, and nothing fails."""
    serving = torch_runner(tiny_cnn_path, device="cuda", instances=2)
    fake.capture_hold_s = 5.0
    done = threading.Event()
    answered = []

    def serve(i: int) -> None:
        while not done.is_set():
            x = images(1 + i % 2, seed=i)
            answered.append(
                np.allclose(serving.run({"input": x})["logits"], reference(x), atol=1e-5)
            )

    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(serve, i) for i in range(4)]
            try:
                loaded = torch_runner(tiny_cnn_path, device="cuda")
            finally:
                done.set()
            for f in futures:
                f.result()
        loaded.close()
        assert answered and all(answered)
    finally:
        serving.close()


def test_two_models_loading_at_once_capture_one_at_a_time(fake, tiny_cnn_path):
    """Defect 6: one capture at a time in the process."""
    with ThreadPoolExecutor(2) as pool:
        runners = list(pool.map(lambda _: torch_runner(tiny_cnn_path, device="cuda"), range(2)))
    for r in runners:
        r.close()
    assert fake.captures == 2 * len(runners[0].graph_sizes)


# ------------------------------------------------- 9: what is served is what is measured


def test_a_pipelines_model_step_on_a_gpu_gets_pinned_staging(fake, tiny_cnn_path, reference):
    """Defect 9: a model inside a Pipeline got the previous step's pageable arrays, so the
    JPEG pipeline never copied from pinned memory."""
    from servekit import FunctionRunner, Pipeline

    model = torch_runner(tiny_cnn_path, device="cuda")
    lane = model._lanes.all[0]
    seen = []
    upload = lane.upload
    lane.upload = lambda name, a, made: seen.append(a) or upload(name, a, made)
    negate = FunctionRunner(
        lambda inputs: {"input": -inputs["raw"]},
        ModelSpec(
            (TensorSpec("raw", np.float32, [3, 32, 32]),),
            (TensorSpec("input", np.float32, [3, 32, 32]),),
            8,
        ),
    )
    pipeline = Pipeline([negate, model])
    try:
        x = images(2)
        np.testing.assert_allclose(
            pipeline.infer({"raw": x})["logits"], reference(-x), rtol=1e-4, atol=1e-5
        )
        with model.staging.lend() as staging:
            buffers = list(staging._buffers.values())
        assert any(np.shares_memory(seen[0], b) for b in buffers)
    finally:
        pipeline.close()


def test_serving_on_cuda_uses_the_cudnn_settings_the_gpu_bench_measures(fake, tiny_cnn_path):
    """Defect 9: bench/gpu.py turned cudnn.benchmark on and serving never did."""
    from pathlib import Path

    torch.backends.cudnn.benchmark = False
    runner = torch_runner(tiny_cnn_path, device="cuda")
    runner.close()
    assert torch.backends.cudnn.benchmark is True
    assert not torch.backends.cudnn.allow_tf32
    bench = (Path(__file__).parents[1] / "bench" / "gpu.py").read_text()
    assert "serving_backends(torch)" in bench and "cudnn.benchmark" not in bench
