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
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import needs_torch
from servekit import cuda as servekit_cuda
from servekit.device import DeviceTensor, gather_on_device

pytestmark = needs_torch

torch = pytest.importorskip("torch")

from fakecuda import FakeCuda, Race  # noqa: E402  (needs torch)


@pytest.fixture
def fake():
    """The fake device as the process's CUDA; nothing it saw may be left unreported."""
    device = FakeCuda()
    with servekit_cuda.use(device):
        yield device
        gc.collect()
        device.check()
    device.close()
    assert device.problems == [], device.problems


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
