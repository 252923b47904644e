"""Triton's CUDA shared memory served by servekit's native runtime.

Where a GPU is (the device, through ``bench/gpu.sh``): tritonclient's
``cuda_shared_memory`` registers buffers on GPU 0 with a native server running a Torch
model there, and eight clients infer through their own regions over HTTP and gRPC; the
answers are the ones the same inputs get over the socket; a handle that does not open,
a device the server lacks and an offset past a region are each a 400 naming it (an
unregistered region a 404, as in Triton), and the server goes on.

Everywhere: the registry's rules (one namespace with system regions, sizes and offsets,
an unregister that waits for the copies on a region) and the HTTP surface run on a
stand-in for the device's memory (``cudamemory.HostMemory``: host bytes behind the same
interface as ``cudashm.open_ipc``, which cannot open a handle without a GPU); a server that sees no
GPU refuses CUDA registrations naming why; requests that carry device tensors
(``DeviceTensor``) are checked and gathered as host arrays are, with torch's CPU tensors
where PyTorch is installed.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import HAS_TORCH, has_cuda, needs_cuda, needs_torch, sample, scrape
from servekit import FunctionRunner, ModelSpec, TensorSpec
from servekit.errors import InvalidInput, RegionNotFound
from servekit.protocol.shm import SharedMemory, ShmRef, cuda_refusal


def test_a_cuda_region_is_listed_by_its_kind_and_shares_the_names(regions, devices, tmp_path):
    handle, _ = devices.allocate(256, device_id=1)
    regions.register_cuda("g", handle, 1, 256)
    assert regions.status(kind="cuda") == [{"name": "g", "device_id": 1, "byte_size": 256}]
    assert regions.status("g", "cuda") == [{"name": "g", "device_id": 1, "byte_size": 256}]
    assert regions.status() == []  # no system region
    with pytest.raises(RegionNotFound, match="'g'"):
        regions.status("g")  # not a system region
    (tmp_path / "k").write_bytes(b"\0" * 64)
    with pytest.raises(InvalidInput, match="'g' is already registered"):
        regions.register("g", "/k", 0, 64)
    regions.register("s", "/k", 0, 64)
    other, _ = devices.allocate(64)
    with pytest.raises(InvalidInput, match="'s' is already registered"):
        regions.register_cuda("s", other, 0, 64)
    regions.unregister("g")  # a system unregister leaves a CUDA region of that name
    assert [r["name"] for r in regions.status(kind="cuda")] == ["g"]
    regions.unregister("g", "cuda")
    assert regions.status(kind="cuda") == [] and devices.opened[0].closed
    assert [r["name"] for r in regions.status()] == ["s"]


def test_what_a_cuda_registration_refuses(regions, devices):
    handle, _ = devices.allocate(64)
    refused = {
        "a short handle": (b"\1" * 63, 0, 64, "64 bytes, got 63 bytes"),
        "a handle that is not bytes": ("abc", 0, 64, "got 'abc'"),
        "a negative device": (handle, -1, 64, "device_id must be a non-negative integer"),
        "a boolean device": (handle, True, 64, "device_id must be a non-negative integer"),
        "no bytes": (handle, 0, 0, "byte_size must be at least 1"),
        "a handle that does not open": (b"\7" * 64, 0, 64, "does not open"),
        "another device's handle": (handle, 1, 64, "does not open"),
    }
    for why, (raw, device_id, size, said) in refused.items():
        with pytest.raises(InvalidInput, match="'g'") as caught:
            regions.register_cuda("g", raw, device_id, size)
            pytest.fail(f"not refused: {why}")
        assert said in str(caught.value), (why, str(caught.value))
    assert regions.status(kind="cuda") == []


def test_inputs_and_outputs_at_their_offsets_and_nothing_past_the_region(regions, devices):
    handle, buffer = devices.allocate(64)
    regions.register_cuda("g", handle, 0, 48)  # the region is the first 48 bytes
    x = np.arange(4, dtype=np.float32)
    buffer[16:32] = x.tobytes()
    got = regions.tensor(ShmRef("g", 16, 16), "x", "FP32", [1, 4])
    assert isinstance(got, np.ndarray) and got.tolist() == [x.tolist()]
    regions.write(ShmRef("g", 32, 16), "y", (x * 2).tobytes())
    assert np.frombuffer(bytes(buffer[32:48]), np.float32).tolist() == (x * 2).tolist()
    with pytest.raises(InvalidInput, match="runs past the end of region 'g' \\(48 bytes\\)"):
        regions.tensor(ShmRef("g", 40, 16), "x", "FP32", [1, 4])
    with pytest.raises(InvalidInput, match="runs past the end of region 'g'"):
        regions.write(ShmRef("g", 40, 16), "y", (x * 2).tobytes())
    with pytest.raises(InvalidInput, match="needs 16 bytes, region 'g' gives 8"):
        regions.tensor(ShmRef("g", 0, 8), "x", "FP32", [1, 4])
    with pytest.raises(RegionNotFound, match="'h'"):
        regions.tensor(ShmRef("h", 0, 16), "x", "FP32", [1, 4])


def test_unregistering_a_region_waits_for_the_copy_on_it(regions, devices):
    handle, buffer = devices.allocate(16)
    buffer[:] = np.arange(4, dtype=np.float32).tobytes()
    regions.register_cuda("g", handle, 0, 16)
    memory = devices.opened[0]
    memory.gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        read = pool.submit(regions.tensor, ShmRef("g", 0, 16), "x", "FP32", [1, 4])
        time.sleep(0.2)  # the copy has started and waits at the gate
        gone = pool.submit(regions.unregister, "g", "cuda")
        time.sleep(0.2)
        assert not gone.done() and not memory.closed, "unmapped under a copy in flight"
        assert regions.status(kind="cuda") == []  # forgotten at once: no new copy starts
        memory.gate.set()
        assert read.result(10).tolist() == [[0, 1, 2, 3]]
        gone.result(10)
    assert memory.closed


def test_for_device_is_the_host_view_unless_a_cuda_model_reads_a_cuda_region(regions, devices):
    assert regions.for_device(None) is regions
    if HAS_TORCH:
        import torch

        assert regions.for_device(torch.device("cpu")) is regions
        assert regions.for_device(torch.device("cuda", 0)) is regions  # no CUDA region yet
        handle, _ = devices.allocate(16)
        regions.register_cuda("g", handle, 0, 16)
        assert regions.for_device(torch.device("cuda", 0)) is not regions


def call(app, method: str, path: str, body: object = None, headers: dict | None = None):
    from servekit.http.messages import HttpRequest

    data = json.dumps(body).encode() if body is not None else b""
    return asyncio.run(app.handle(HttpRequest(method, path, headers or {}, data)))


def test_over_http_a_client_registers_infers_through_and_unregisters_a_region(devices, tmp_path):
    from servekit.http import KServeApp

    spec = ModelSpec(
        (TensorSpec("x", np.float32, [4]),), (TensorSpec("y", np.float32, [4]),), max_batch_size=4
    )
    regions = SharedMemory(str(tmp_path), open_cuda=devices.open)
    app = KServeApp(
        {"double": FunctionRunner(lambda inputs: {"y": inputs["x"] * 2}, spec)},
        shared_memory=regions,
    )
    handle, buffer = devices.allocate(64)
    b64 = base64.b64encode(handle).decode()
    register = "/v2/cudasharedmemory/region/g/register"
    body = {"raw_handle": {"b64": b64}, "device_id": 0, "byte_size": 64}
    assert call(app, "POST", register, body)[0] == 200
    status, listed, _ = call(app, "GET", "/v2/cudasharedmemory/status")
    assert status == 200 and json.loads(listed) == [{"name": "g", "device_id": 0, "byte_size": 64}]
    assert json.loads(call(app, "GET", "/v2/systemsharedmemory/status")[1]) == []

    x = np.array([[1, 2, 3, 4]], np.float32)
    buffer[:16] = x.tobytes()
    span = lambda offset: {  # noqa: E731
        "shared_memory_region": "g", "shared_memory_offset": offset, "shared_memory_byte_size": 16,
    }  # fmt: skip
    request = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": span(0)}],
        "outputs": [{"name": "y", "parameters": span(16)}],
    }
    status, answer, _ = call(app, "POST", "/v2/models/double/infer", request)
    assert status == 200, answer
    assert np.frombuffer(bytes(buffer[16:32]), np.float32).tolist() == [2, 4, 6, 8]
    exposed = call(app, "GET", "/metrics")[1].decode()  # a model on the host: both copies
    for tensor in ("input", "output"):  # went through host memory
        assert f'copies_total{{tensor="{tensor}",path="host"}} 1' in exposed, exposed
    request["inputs"][0]["parameters"] = span(56)
    status, answer, _ = call(app, "POST", "/v2/models/double/infer", request)
    assert status == 400 and b"'x'" in answer and b"past the end of region 'g'" in answer, answer

    bad = {
        "not base64": ({"raw_handle": {"b64": "%%%"}, "device_id": 0, "byte_size": 8}, b"base64"),
        "no handle": ({"device_id": 0, "byte_size": 8}, b"raw_handle"),
        "a short handle": (
            {
                "raw_handle": {"b64": base64.b64encode(b"x").decode()},
                "device_id": 0,
                "byte_size": 8,
            },
            b"got 1 bytes",
        ),
        "taken": (body, b"already registered"),
    }
    for why, (data, said) in bad.items():
        status, answer, _ = call(app, "POST", register, data)
        assert status == 400 and said in answer, (why, status, answer)
    assert call(app, "POST", "/v2/cudasharedmemory/region/g/unregister")[0] == 200
    assert json.loads(call(app, "GET", "/v2/cudasharedmemory/status")[1]) == []
    status, answer, _ = call(app, "POST", "/v2/models/double/infer", request)
    assert status == 404 and b"'g' is not registered" in answer, answer  # Triton's code
    regions.close()


def test_a_server_that_sees_no_gpu_says_why():
    regions = SharedMemory()
    said = cuda_refusal(regions)
    if has_cuda():
        assert said is None
        return
    assert said is not None and "CUDA shared memory is not served by this server" in said
    assert "native runtime" in said and ("no CUDA device" in said or "cuda-python" in said)
    if importlib.util.find_spec("cuda") is not None:  # cuda-python without a driver or device
        from servekit.protocol.cudashm import open_ipc

        with pytest.raises(InvalidInput, match="'r'|device 0"):
            open_ipc("r", b"\0" * 64, 0, 64)


@needs_torch
def test_device_tensors_are_checked_and_gathered_like_host_arrays():
    import torch

    from servekit.device import DeviceTensor
    from servekit.runners.staging import StagingPool

    spec = ModelSpec(
        (TensorSpec("x", np.float32, [3]),), (TensorSpec("y", np.float32, [3]),), max_batch_size=8
    )
    a = DeviceTensor(torch.arange(6, dtype=torch.float32).reshape(2, 3), np.float32)
    assert spec.validate_inputs({"x": a}) == 2
    wrong = DeviceTensor(torch.zeros(2, 3, dtype=torch.float64), np.float64)
    with pytest.raises(InvalidInput, match="'x': expected dtype FP32, got FP64"):
        spec.validate_inputs({"x": wrong})
    with pytest.raises(InvalidInput, match="'x': expected shape"):
        spec.validate_inputs({"x": DeviceTensor(torch.zeros(2, 4), np.float32)})
    assert np.asarray(a).tolist() == [[0, 1, 2], [3, 4, 5]]  # a host copy where one is wanted

    host = np.full((1, 3), 9, np.float32)
    with StagingPool(8, pinned=True).lend() as staging:
        batch = staging.gather([{"x": a}, {"x": host}, {"x": a}], ["x"])["x"]
        assert isinstance(batch, DeviceTensor) and batch.device == a.device
        assert batch.tensor.tolist() == [[0, 1, 2], [3, 4, 5], [9, 9, 9], [0, 1, 2], [3, 4, 5]]
        assert staging.allocations == 0  # no host buffer: the rows never crossed the host


@pytest.fixture(scope="module")
def gpu_server(tiny_cnn_path):
    """A native server running a Torch model on GPU 0 (two lanes), both protocols."""
    if not has_cuda():
        pytest.skip("no CUDA GPU (PyTorch sees none)")
    from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig
    from servekit.bench.compare import ServerProcess

    config = ServeConfig(
        (
            ModelConfig(
                str(tiny_cnn_path), "tiny", engine="torch", precision="fp32", instances=2,
                image=False, batching=BatchingPolicy(max_batch_size=16, max_queue_delay_us=500),
            ),
        ),
        ServerConfig(exit_timeout_s=2, control_token="cuda-token"),
        runtime="native",
    ).on_loopback()  # fmt: skip
    with ServerProcess(config) as served:
        served.wait_ready(["tiny"])
        yield served


@needs_cuda
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_eight_clients_infer_through_their_own_regions_on_the_gpu(gpu_server, protocol):
    """Inputs read on the GPU where the model runs, outputs kept there and written device
    to device into each client's region (``test_cuda_outputs``): the answers are those the
    same inputs get over the socket."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.cuda_shared_memory as cudashm
    from tritonclient.utils import InferenceServerException

    m = grpcclient if protocol == "grpc" else httpclient
    prefix = "triton-grpc-protocol-" if protocol == "grpc" else ""
    headers = {f"{prefix}servekit-control-token": "cuda-token"}
    server = gpu_server.config.server
    address = (server.grpc_url if protocol == "grpc" else server.http_url).split("//")[-1]
    rows, in_bytes, out_bytes = 2, 2 * 3 * 32 * 32 * 4, 2 * 10 * 4

    def client_run(i: int) -> None:
        client = m.InferenceServerClient(address)
        name = f"gpu{i}-{protocol}"
        handle = cudashm.create_shared_memory_region(name, in_bytes + out_bytes, 0)
        try:
            client.register_cuda_shared_memory(
                name, cudashm.get_raw_handle(handle), 0, in_bytes + out_bytes, headers=headers
            )
            rng = np.random.default_rng(i)
            xs = [rng.standard_normal((rows, 3, 32, 32)).astype(np.float32) for _ in range(8)]
            wants = []
            for x in xs:  # over the socket first: the shared-memory batches are then pure
                plain = m.InferInput("input", list(x.shape), "FP32")
                plain.set_data_from_numpy(x)
                wants.append(client.infer("tiny", [plain]).as_numpy("logits"))
            for x, want in zip(xs, wants, strict=True):
                cudashm.set_shared_memory_region(handle, [x])
                tensor = m.InferInput("input", list(x.shape), "FP32")
                tensor.set_shared_memory(name, in_bytes)
                out = m.InferRequestedOutput("logits")
                out.set_shared_memory(name, out_bytes, offset=in_bytes)
                client.infer("tiny", [tensor], outputs=[out])
                got = cudashm.get_contents_as_numpy(handle, np.float32, [rows, 10], offset=in_bytes)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            past = m.InferInput("input", [rows, 3, 32, 32], "FP32")
            past.set_shared_memory(name, in_bytes, offset=out_bytes + 8)
            with pytest.raises(InferenceServerException, match=f"past the end of region '{name}'"):
                client.infer("tiny", [past])
        finally:
            client.unregister_cuda_shared_memory(name, headers=headers)
            cudashm.destroy_shared_memory_region(handle)
            client.close()

    with ThreadPoolExecutor(8) as pool:
        for done in [pool.submit(client_run, i) for i in range(8)]:
            done.result(120)
    copies = scrape(gpu_server.config.server.metrics_url)
    family = "servekit_cuda_shared_memory_copies_total"
    assert sample(copies, family, tensor="input", path="device") >= 8 * 8
    assert sample(copies, family, tensor="output", path="device") > 0, "none kept on the GPU"

    client = m.InferenceServerClient(address)
    spare = cudashm.create_shared_memory_region(f"spare-{protocol}", 1024, 0)
    try:
        good = cudashm.get_raw_handle(spare)
        refused = {
            "a handle that does not open": (base64.b64encode(b"\7" * 64), 0, 1024, "does not open"),
            "a device the server lacks": (good, 64, 1024, "device_id 64"),
            "more bytes than the allocation": (good, 0, 1 << 30, "exceeds the"),
        }
        for why, (raw, device_id, size, said) in refused.items():
            with pytest.raises(InferenceServerException, match=said):
                client.register_cuda_shared_memory("bad", raw, device_id, size, headers=headers)
                pytest.fail(f"not refused: {why}")
        status = client.get_cuda_shared_memory_status(headers=headers)
        assert not (list(status.regions) if protocol == "grpc" else status)
        assert client.is_server_live()
    finally:
        cudashm.destroy_shared_memory_region(spare)
        client.close()


def test_a_client_without_a_gpu_says_it_cannot_make_a_cuda_region():
    """servekit's client (and so ``servekit bench --shared-memory cuda``) names what this
    host lacks before it asks the server anything; an unknown kind is refused."""
    pytest.importorskip("tritonclient.http")
    from servekit.client import Client
    from servekit.errors import SetupError

    with pytest.raises(ValueError, match="none, system or cuda, got 'gpu'"):
        Client("http://127.0.0.1:9", shared_memory="gpu")
    if has_cuda():
        return
    said = "cannot make a cuda shared-memory region of 64 bytes"
    with (
        Client("http://127.0.0.1:9", shared_memory="cuda") as client,
        pytest.raises(SetupError, match=said),
    ):
        client.prepare({"x": np.zeros((1, 16), np.float32)})


def test_a_copy_that_fails_on_the_device_names_the_tensor_and_the_region(regions, devices):
    """A CUDA error while copying (the region is registered and the span fits) is the
    server's, a 500 that says which tensor and region it was for."""
    from servekit.errors import RunnerError

    handle, _ = devices.allocate(16)
    regions.register_cuda("g", handle, 0, 16)
    memory = devices.opened[0]

    def broken(*_):
        raise RuntimeError("cudaErrorIllegalAddress")

    memory.to_host = memory.from_host = broken
    with pytest.raises(RunnerError, match="input 'x': copying from CUDA .* 'g': cudaErrorIllegal"):
        regions.tensor(ShmRef("g", 0, 16), "x", "FP32", [1, 4])
    with pytest.raises(RunnerError, match="output 'y': copying into CUDA .* 'g'"):
        regions.write(ShmRef("g", 0, 16), "y", b"\0" * 16)
    regions.unregister("g", "cuda")  # nothing left held by the failed copies
    assert memory.closed
