"""Outputs kept on the device for requests whose outputs all go into CUDA shared memory.

A request read from CUDA regions on the model's GPU whose every output also goes into a
CUDA region there is answered on the device: its batch (when every request in it asks the
same) runs without a copy of the outputs to the host, and each request's rows are copied
device to device into its region. A request that wants any output over the wire, in a
system region or on another device, and any batch it shares, is answered on the host as
before. The answers are the same either way.

Without a GPU, torch's CPU stands for the device: the regions are ``cudamemory``'s host
buffers (which count the writes made from device tensors apart from host bytes), the
registry is read as a model on ``cuda:0`` reads it (``OnDevice``), and a real Batcher runs
a real ``TorchRunner`` on the CPU. The GPU test in ``test_cuda_shared_memory`` runs the
same path on the device (``bench/gpu.sh``).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import needs_torch
from servekit.errors import InvalidInput
from servekit.protocol.shm import ShmRef

pytestmark = needs_torch

ROWS = 2
IN_BYTES, OUT_BYTES = ROWS * 3 * 32 * 32 * 4, ROWS * 10 * 4


def on_gpu(regions):
    """The registry as a model on ``cuda:0`` reads it (``SharedMemory.for_device``)."""
    import torch

    from servekit.protocol.cudashm import OnDevice

    return OnDevice(regions, torch.device("cuda", 0))


def span(region: str, offset: int, size: int) -> dict:
    return {
        "shared_memory_region": region, "shared_memory_offset": offset,
        "shared_memory_byte_size": size,
    }  # fmt: skip


def http_request(outputs: list[dict] | None, region: str = "g") -> bytes:
    body: dict = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [ROWS, 3, 32, 32],
                    "parameters": span(region, 0, IN_BYTES)}],
    }  # fmt: skip
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body).encode()


def grpc_request(*outputs: tuple[str, dict], region: str = "g"):
    """A ``ModelInferRequest`` of the input in ``region``, asking for ``outputs`` (name,
    parameters)."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[ROWS, 3, 32, 32])
    for msg, params in [(tensor, span(region, 0, IN_BYTES))] + [
        (request.outputs.add(name=name), params) for name, params in outputs
    ]:
        for key, value in params.items():
            kind = "string_param" if isinstance(value, str) else "int64_param"
            setattr(msg.parameters[key], kind, value)
    return request


def test_a_request_is_answered_on_the_device_only_where_every_output_goes_there(
    regions, devices, tmp_path
):

    from servekit.grpc.tensors import decode_inputs
    from servekit.protocol.kserve import decode_request

    for name, device_id in (("g", 0), ("other", 1)):
        handle, _ = devices.allocate(IN_BYTES + OUT_BYTES, device_id)
        regions.register_cuda(name, handle, device_id, IN_BYTES + OUT_BYTES)
    (tmp_path / "sys").write_bytes(b"\0" * OUT_BYTES)
    regions.register("sys", "/sys", 0, OUT_BYTES)
    out_g = {"name": "logits", "parameters": span("g", IN_BYTES, OUT_BYTES)}
    cases = {
        "its output in a CUDA region on the model's device": ([out_g], True),
        "no outputs named: they come in the response": (None, False),
        "its output over the wire": ([{"name": "logits"}], False),
        "its output in a CUDA region on another device": (
            [{"name": "logits", "parameters": span("other", 0, OUT_BYTES)}], False,
        ),
        "its output in a system region": (
            [{"name": "logits", "parameters": span("sys", 0, OUT_BYTES)}], False,
        ),
        "its output classified (on the host)": (
            [{"name": "logits", "parameters": {**span("g", IN_BYTES, OUT_BYTES),
                                                "classification": 3}}], False,
        ),
    }  # fmt: skip
    for why, (outputs, kept) in cases.items():
        decoded = decode_request(http_request(outputs), regions=on_gpu(regions))
        assert decoded.inputs["input"].keep_outputs is kept, why
        # The same registry read for the host (a model on the CPU) never keeps anything.
        assert isinstance(decode_request(http_request(outputs), regions=regions).inputs["input"],
                          np.ndarray), why  # fmt: skip

    in_g = span("g", IN_BYTES, OUT_BYTES)
    grpc_cases = {
        "its output in a CUDA region on the model's device": ([("logits", in_g)], True),
        "no outputs named": ([], False),
        "its output over the wire": ([("logits", {})], False),
        "its output classified": ([("logits", {**in_g, "classification": 3})], False),
    }
    for why, (outputs, kept) in grpc_cases.items():
        inputs = decode_inputs(grpc_request(*outputs), regions=on_gpu(regions))
        assert inputs["input"].keep_outputs is kept, why


def test_a_batch_is_kept_on_the_device_only_where_every_request_in_it_asks(tiny_cnn_path):
    import torch

    from servekit.device import DeviceTensor
    from servekit.runners.torch import TorchRunner

    runner = TorchRunner(tiny_cnn_path, device="cpu", precision="fp32", max_batch_size=8)
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((ROWS, 3, 32, 32)).astype(np.float32) for _ in range(3)]
    want = runner.infer({"input": np.concatenate(x)})["logits"]

    def device(a, keep):
        return DeviceTensor(torch.from_numpy(a), np.float32, keep)

    batches = {
        "every request asks": ([device(a, True) for a in x], True),
        "one request's outputs go to the host": (
            [device(x[0], True), device(x[1], False), device(x[2], True)], False,
        ),
        "one request came over the wire": ([device(x[0], True), x[1], device(x[2], True)], False),
    }  # fmt: skip
    for why, (parts, kept) in batches.items():
        with runner.staging.lend() as staging:
            batch = staging.gather([{"input": p} for p in parts], ["input"])
            got = runner.run(batch)["logits"]
        assert isinstance(got, DeviceTensor) is kept, why
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    runner.close()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.sampled_from(["wire", "device", "kept"])),
        min_size=1, max_size=6,
    ),
    st.integers(0, 2**16),
)  # fmt: skip
def test_each_request_gets_its_own_rows_on_the_device_only_where_its_whole_batch_asked(
    requests, seed
):
    """The one execution path (``batch_steps``, staging, split) with a real TorchRunner:
    requests of any rows, sent over the wire, read on the device, or read there wanting
    their outputs there, each get their own rows; a batch's outputs are ``DeviceTensor``s
    exactly when every request in it wants them so."""
    import torch

    from servekit import ModelSpec, TensorSpec
    from servekit.batching.execute import batch_steps, drive
    from servekit.device import DeviceTensor
    from servekit.runners.torch import TorchRunner

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    spec = ModelSpec(
        (TensorSpec("x", np.float32, [4]),), (TensorSpec("y", np.float32, [3]),), max_batch_size=18
    )
    runner = TorchRunner(module, spec=spec, device="cpu", precision="fp32", channels_last=False)
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((rows, 4)).astype(np.float32) for rows, _ in requests]
    sent = [
        {"x": x if how == "wire" else DeviceTensor(torch.from_numpy(x), np.float32, how == "kept")}
        for x, (_, how) in zip(xs, requests, strict=True)
    ]
    steps = batch_steps(sent, [r for r, _ in requests], ["x"], spec.check_outputs, "linear",
                        runner.staging)  # fmt: skip
    answers = drive(steps, runner.run)
    kept = all(how == "kept" for _, how in requests)
    with torch.inference_mode():
        for x, answer in zip(xs, answers, strict=True):
            assert isinstance(answer["y"], DeviceTensor) is kept
            want = module(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(np.asarray(answer["y"]), want, rtol=1e-5, atol=1e-6)


def test_eight_clients_through_their_own_regions_each_answered_device_to_device(
    regions, devices, tiny_cnn_path
):
    """Eight concurrent requests, decoded as the native runtime decodes them for a model on
    the GPU, batched by a real Batcher (finite outputs required) over a real TorchRunner,
    and encoded over HTTP and gRPC: every output is written into its client's region from
    the kept tensor, and it is the answer the same inputs get over the socket."""

    from servekit import BatchingPolicy
    from servekit.batching import Batcher
    from servekit.grpc.tensors import decode_inputs, infer_response
    from servekit.protocol.kserve import decode_request, encode_response
    from servekit.runners.torch import TorchRunner

    runner = TorchRunner(tiny_cnn_path, device="cpu", precision="fp32", max_batch_size=16)
    clients = []
    for i in range(8):
        handle, buffer = devices.allocate(IN_BYTES + OUT_BYTES)
        regions.register_cuda(f"c{i}", handle, 0, IN_BYTES + OUT_BYTES)
        clients.append((f"c{i}", buffer, devices.opened[-1]))
    view = on_gpu(regions)
    rows_seen: list[int] = []

    async def client(i: int, batcher: Batcher, rounds: int) -> None:
        name, buffer, _ = clients[i]
        rng = np.random.default_rng(i)
        for r in range(rounds):
            x = rng.standard_normal((ROWS, 3, 32, 32)).astype(np.float32)
            buffer[:IN_BYTES] = x.tobytes()
            out = span(name, IN_BYTES, OUT_BYTES)
            if (i + r) % 2:
                request = grpc_request(("logits", out), region=name)
                inputs = decode_inputs(request, regions=view)
                assert inputs["input"].keep_outputs
                outputs = await batcher.infer(inputs)
                infer_response(request, outputs, ["logits"], "1", regions)
            else:
                decoded = decode_request(
                    http_request([{"name": "logits", "parameters": out}], name), regions=view
                )
                outputs = await batcher.infer(decoded.inputs)
                body, _ = encode_response("tiny", outputs, decoded)
                # as tritonserver answers it: no parameters (NVIDIA's C++ client reads them
                # as binary_data_size)
                assert "parameters" not in json.loads(body)["outputs"][0]
            got = np.frombuffer(bytes(buffer[IN_BYTES:]), np.float32).reshape(ROWS, 10)
            np.testing.assert_allclose(got, runner.infer({"input": x})["logits"], 1e-4, 1e-4)

    async def main() -> None:
        policy = BatchingPolicy(max_batch_size=16, max_queue_delay_us=20_000)
        listen = lambda record: rows_seen.append(record.rows)  # noqa: E731
        async with Batcher(runner, policy, require_finite=True, listeners=[listen]) as batcher:
            await asyncio.gather(*(client(i, batcher, 4) for i in range(8)))

    asyncio.run(main())
    assert max(rows_seen) > ROWS, f"no batch gathered two requests: {rows_seen}"
    for name, _, memory in clients:
        assert memory.writes == {"host": 0, "device": 4}, name
    ((family, kind, _, samples),) = regions.figures()  # what GET /metrics shows
    assert (family, kind) == ("servekit_cuda_shared_memory_copies_total", "counter")
    assert sorted((s["tensor"], s["path"], n) for s, n in samples) == [
        ("input", "device", 32.0), ("output", "device", 32.0),
    ]  # fmt: skip
    runner.close()


def test_a_kept_output_into_a_system_region_or_the_cache_goes_through_the_host(regions, tmp_path):
    import torch

    from servekit.cache.query import encode_tensors
    from servekit.device import DeviceTensor
    from servekit.protocol.shm import write_output

    y = np.arange(8, dtype=np.float32).reshape(2, 4)
    kept = DeviceTensor(torch.from_numpy(y.copy()), np.float32)
    (tmp_path / "k").write_bytes(b"\0" * 64)
    regions.register("s", "/k", 0, 64)
    assert write_output(regions, ShmRef("s", 16, 32), "y", kept) == 32
    assert (tmp_path / "k").read_bytes()[16:48] == y.tobytes()
    assert encode_tensors({"y": kept}) == encode_tensors({"y": y})
    with pytest.raises(InvalidInput, match="output 'y': its 32 bytes do not fit the 16 bytes"):
        write_output(regions, ShmRef("s", 0, 16), "y", kept)
