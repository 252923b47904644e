"""GPU memory that outlives its batches, and no longer: pinned staging owned by the version
that serves each batch, sized to the model's inputs, freed at close and counted; TensorRT's
lanes on non-blocking streams; graphs only for fixed shapes; capture beside serving; a
pipeline's model step in pinned staging. Run on the fake device (``fakecuda``), TensorRT
as ``faketensorrt``: the runners' own code, with memory that is poisoned when freed."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

from conftest import needs_torch
from servekit import Batcher, BatchingPolicy, ModelSpec, TensorSpec
from servekit.runners.staging import StagingPool
from servekit.runners.versioned import VersionedRunner

pytestmark = needs_torch

torch = pytest.importorskip("torch")

import faketensorrt  # noqa: E402  (needs torch through fakecuda)


@pytest.fixture
def fake(fake_cuda):
    return fake_cuda


@pytest.fixture
def tensorrt(fake, monkeypatch):
    """TensorRT's Python API as ``faketensorrt`` (the engine is ONNX Runtime)."""
    monkeypatch.setitem(sys.modules, "tensorrt", faketensorrt)
    return faketensorrt


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(tiny_cnn_path):
    from servekit.runners.onnx import OnnxRuntimeRunner

    runner = OnnxRuntimeRunner(tiny_cnn_path)
    return lambda x: runner.infer({"input": x})["logits"]


def trt_runner(path, cache, **kw):
    from servekit.runners.tensorrt import TensorRTRunner

    return TensorRTRunner(path, precision="fp32", max_batch_size=8, cache_dir=cache, **kw)


def serve(batcher: Batcher, batches: list[np.ndarray]) -> list[np.ndarray]:
    async def main():
        return await asyncio.gather(*(batcher.infer({"input": x}) for x in batches))

    return [out["logits"] for out in asyncio.run(main())]


# ------------------------------------------------------- 2: staging owned by its version


def test_after_two_live_updates_no_batch_is_gathered_into_freed_pinned_memory(
    fake, tensorrt, tiny_cnn_path, reference, tmp_path
):
    """Defect 2: the Batcher took the first version's staging once; two updates closed that
    version (cudaFreeHost), and later batches were gathered into freed memory. Now each
    batch borrows the serving version's staging, which stays open until it is given back."""
    versioned = VersionedRunner(trt_runner(tiny_cnn_path, tmp_path), name="cnn")
    batcher = Batcher(versioned, BatchingPolicy(max_queue_delay_us=1000))
    runtime = fake.runtime()
    try:
        xs = [images(1 + i % 3, seed=i) for i in range(8)]
        for got, x in zip(serve(batcher, xs), xs, strict=True):
            np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)
        first = versioned.runner
        versioned.update(trt_runner(tiny_cnn_path, tmp_path))
        versioned.update(trt_runner(tiny_cnn_path, tmp_path))
        assert first.staging.pinned_bytes == 0 and runtime.freed  # the first version's, freed
        for got, x in zip(serve(batcher, xs), xs, strict=True):
            np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)
        assert batcher.pinned_bytes == versioned.runner.staging.pinned_bytes > 0
    finally:
        batcher.close()
        versioned.close()


def test_a_version_is_freed_only_once_no_batch_holds_its_staging(
    fake, tensorrt, tiny_cnn_path, tmp_path
):
    """Defect 2: a batch holding a staging keeps its version open across updates."""
    versioned = VersionedRunner(trt_runner(tiny_cnn_path, tmp_path), name="cnn")
    first = versioned.runner
    try:
        with versioned.staging.lend() as staging:
            versioned.update(trt_runner(tiny_cnn_path, tmp_path))
            versioned.update(trt_runner(tiny_cnn_path, tmp_path))
            assert first.staging.pinned_bytes > 0  # still held by this batch
            batch = staging.gather([{"input": images(2)}], ["input"])
            assert np.isfinite(batch["input"]).all()
        assert first.staging.pinned_bytes == 0  # given back: freed now
    finally:
        versioned.close()


# ------------------------------------------------ 3: staging sized to the model's inputs


def nine_inputs() -> ModelSpec:
    return ModelSpec(
        tuple(TensorSpec(f"x{i}", np.float32, [4]) for i in range(9)),
        (TensorSpec("y", np.float32, [4]),),
        16,
    )


def test_nine_inputs_keep_nine_buffers_allocated_up_front_per_lane():
    """Defect 3: at most 8 buffers were kept, so a ninth input reallocated every input of
    every batch (on TensorRT a cudaMallocHost each, never freed: pinned memory grew without
    bound), and warm-up bypassed staging so the first live batches allocated too."""
    made, freed = [], []

    def alloc(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]

    spec = nine_inputs()
    inputs = [(t.name, t.dtype.numpy, tuple(t.shape)) for t in spec.inputs]
    pool = StagingPool(16, alloc, pinned=True, free=freed.append, inputs=inputs, lanes=2)
    assert pool.allocations == 18 and pool.pinned_bytes == 18 * 16 * 4 * 4  # before a batch
    rng = np.random.default_rng(0)
    for n in [1, 16, 3, 7, 16, 2] * 20:
        with pool.lend() as staging:
            requests = [
                {t.name: rng.standard_normal((n, 4)).astype(np.float32) for t in spec.inputs}
            ]
            batch = staging.gather(requests, [t.name for t in spec.inputs])
            for name, value in requests[0].items():
                np.testing.assert_array_equal(batch[name], value)
    assert pool.allocations == 18 and not freed
    pool.close()
    assert len(freed) == 18 and pool.pinned_bytes == 0


def test_a_grown_buffer_gives_the_old_one_back():
    made, freed = [], []
    pool = StagingPool(64, lambda s, d: made.append(np.empty(s, d)) or made[-1], pinned=True,
                       free=freed.append)  # fmt: skip
    for rows in (1, 2, 4, 64):
        with pool.lend() as staging:
            staging.gather([{"x": np.ones((rows, 8), np.float32)}], ["x"])
    assert len(made) == 4 and [f.nbytes for f in freed] == [m.nbytes for m in made[:3]]
    assert pool.pinned_bytes == 64 * 8 * 4


def test_tensorrt_pinned_memory_stays_flat_under_load(
    fake, tensorrt, tiny_cnn_path, reference, tmp_path
):
    """Defect 3 on TensorRT: what its staging holds is allocated once, counted in
    ``servekit_staging_pinned_bytes``, and freed at close."""
    from servekit import Metrics

    runner = trt_runner(tiny_cnn_path, tmp_path, instances=2)
    batcher = Batcher(runner, BatchingPolicy(max_queue_delay_us=1000), instance_count=2)
    metrics = Metrics()
    metrics.watch(batcher, "cnn")
    runtime = fake.runtime()
    try:
        held = batcher.pinned_bytes
        assert held == 2 * 8 * 3 * 32 * 32 * 4  # a staging per lane, the model's max batch
        live = len(runtime._memory)
        for round_ in range(5):
            xs = [images(1 + i % 4, seed=round_ * 16 + i) for i in range(16)]
            for got, x in zip(serve(batcher, xs), xs, strict=True):
                np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)
        assert len(runtime._memory) == live and batcher.pinned_bytes == held
        assert (
            f'servekit_staging_pinned_bytes{{model="cnn",version="1"}} {held}' in metrics.render()
        )
    finally:
        batcher.close()
        runner.close()
    assert runner.staging.pinned_bytes == 0 and len(runtime.freed) >= 2


# ------------------------------------------- 5: non-blocking streams, no legacy stream


def test_tensorrt_lanes_run_on_non_blocking_streams_and_never_on_the_legacy_one(
    fake, tensorrt, tiny_cnn_path, reference, tmp_path
):
    """Defect 5: cudaStreamCreate made blocking streams, which synchronise with the legacy
    default stream, and servekit cast device inputs there: a barrier across every lane."""
    from servekit.device import DeviceTensor

    runner = trt_runner(tiny_cnn_path, tmp_path, instances=2)
    try:
        assert fake.blocking == 0
        maker = fake.new_stream("client")
        x = images(3)
        with fake.using(maker):
            t = torch.empty((3, 3, 32, 32), dtype=torch.float64)
            t.copy_(torch.from_numpy(x.astype(np.float64)), non_blocking=True)
        fake.legacy, fake.legacy_ops[:] = 0, []
        device_input = DeviceTensor(t, np.dtype(np.float64), ready=fake.ready(maker))
        got = runner.run({"input": device_input})["logits"]
        np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)
        got = runner.run({"input": x})["logits"]
        np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)
        assert fake.legacy == 0, fake.legacy_ops
    finally:
        runner.close()


# ------------------------------------- CUDA shared memory: the real mapping and copies


def test_eight_clients_through_cuda_shared_memory_run_the_real_ipc_code(
    fake, tiny_cnn_path, reference
):
    """CUDA shared memory's own code (``cudashm._IpcMemory``: the handle opened, the size
    behind it checked, reads to the device and writes from it) on the fake device: eight
    clients' regions, their requests batched over two lanes, every output written device
    to device into its region, no access unordered and nothing on the legacy stream."""
    import json

    from servekit.protocol.cudashm import OnDevice, open_ipc
    from servekit.protocol.kserve import decode_request, encode_response
    from servekit.protocol.shm import SharedMemory
    from servekit.runners.torch import TorchRunner

    rows, in_bytes, out_bytes = 2, 2 * 3 * 32 * 32 * 4, 2 * 10 * 4
    runtime = fake.runtime()
    regions = SharedMemory(open_cuda=open_ipc)
    view = OnDevice(regions, torch.device("cuda", 0))
    buffers = []
    for i in range(8):
        ptr = runtime.cudaMalloc(in_bytes + out_bytes)[1]
        regions.register_cuda(f"c{i}", runtime.export(ptr), 0, in_bytes + out_bytes)
        buffers.append(runtime._memory[ptr])
    runner = TorchRunner(
        tiny_cnn_path, device="cuda", precision="fp32", max_batch_size=16, instances=2
    )
    fake.legacy, fake.legacy_ops[:] = 0, []

    def span(region, offset, size):
        return {"shared_memory_region": region, "shared_memory_offset": offset,
                "shared_memory_byte_size": size}  # fmt: skip

    async def client(i: int, batcher: Batcher) -> None:
        rng = np.random.default_rng(i)
        for _ in range(3):
            x = rng.standard_normal((rows, 3, 32, 32)).astype(np.float32)
            buffers[i][:in_bytes] = np.frombuffer(x.tobytes(), np.uint8)
            body = {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 3, 32, 32],
                            "parameters": span(f"c{i}", 0, in_bytes)}],
                "outputs": [{"name": "logits", "parameters": span(f"c{i}", in_bytes, out_bytes)}],
            }  # fmt: skip
            decoded = decode_request(json.dumps(body).encode(), regions=view)
            assert decoded.inputs["input"].keep_outputs
            outputs = await batcher.infer(decoded.inputs)
            encode_response("tiny", outputs, decoded)
            got = buffers[i][in_bytes:].view(np.float32).reshape(rows, 10)
            np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-5)

    async def main() -> None:
        policy = BatchingPolicy(max_batch_size=16, max_queue_delay_us=5_000)
        async with Batcher(runner, policy, instance_count=2) as batcher:
            await asyncio.gather(*(client(i, batcher) for i in range(8)))

    try:
        asyncio.run(main())
        ((_, _, _, samples),) = regions.figures()
        assert sorted((s["tensor"], s["path"], n) for s, n in samples) == [
            ("input", "device", 24.0), ("output", "device", 24.0),
        ]  # fmt: skip
        assert fake.legacy == 0, fake.legacy_ops
    finally:
        regions.unregister(None, "cuda")
        runner.close()
