"""Triton's system shared memory, end to end: tritonclient registers regions, sends an
infer's inputs through them and asks for its outputs in them, over HTTP and gRPC, on the
native runtime (servekit reads and writes the regions) and on the pytriton and triton
runtimes (through servekit's front to tritonserver, which reads them), eight clients at
once. Registration is behind the control token; a region too small, an offset past its
end and an unregistered region are each a clear 400 / INVALID_ARGUMENT, and the server
goes on. ``SharedMemory``'s own checks (keys, symbolic links, a shrunk object) run in
process."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

pytest.importorskip("tritonclient.http")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import each_client, sample, scrape  # noqa: E402
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.bench.compare import ServerProcess  # noqa: E402
from servekit.errors import InvalidInput, RegionNotFound  # noqa: E402
from servekit.protocol.shm import SharedMemory, ShmRef, cuda_refusal  # noqa: E402

TOKEN = "shm-control-token"
ROW = 16
ROW_BYTES = ROW * 4


def token_headers(protocol: str) -> dict[str, str]:
    """The control token, as servekit reads it on every runtime (the Triton runtimes'
    front checks it, then reaches tritonserver with its own)."""
    prefix = "triton-grpc-protocol-" if protocol == "grpc" else ""
    return {f"{prefix}servekit-control-token": TOKEN}


@pytest.fixture(scope="module", params=["native", "pytriton", "triton"])
def server(request, add_sub_path):
    if request.param != "native":
        pytest.importorskip("pytriton", reason="needs the triton extra")
    config = ServeConfig(
        (
            ModelConfig(
                str(add_sub_path), "adder", threads=1,
                batching=BatchingPolicy(max_batch_size=8, max_queue_delay_us=500),
            ),
        ),
        ServerConfig(exit_timeout_s=2, control_token=TOKEN),
        runtime=request.param,
    ).on_loopback()  # fmt: skip
    with ServerProcess(config) as served:
        served.wait_ready(["adder"])
        yield served


class Region:
    """A client's region: the two inputs then the two outputs of ``rows`` rows."""

    def __init__(
        self, client, protocol: str, rows: int = 2, size: int | None = None, prefix: str = "r"
    ) -> None:
        self.client, self.protocol, self.rows = client, protocol, rows
        unique = uuid.uuid4().hex[:12]
        self.name, self.key = f"{prefix}{unique}", f"/r{unique}"
        self.size = size if size is not None else 4 * rows * ROW_BYTES
        self.handle = shm.create_shared_memory_region(self.name, self.key, self.size)
        client.register_system_shared_memory(
            self.name, self.key, self.size, headers=token_headers(protocol)
        )

    def close(self) -> None:
        try:
            self.client.unregister_system_shared_memory(
                self.name, headers=token_headers(self.protocol)
            )
        finally:
            shm.destroy_shared_memory_region(self.handle)


def module(protocol: str):
    return grpcclient if protocol == "grpc" else httpclient


def client_of(server, protocol: str):
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(server.config.server.grpc_url.split("//")[-1])
    return httpclient.InferenceServerClient(server.config.server.http_url.split("//")[-1])


def shm_infer(client, protocol: str, region: Region, a: np.ndarray, b: np.ndarray, **spans):
    """Infer ``a + b``, ``a - b`` with every tensor in ``region``; ``spans`` overrides a
    tensor's (offset, byte_size)."""
    m = module(protocol)
    nbytes = a.nbytes
    shm.set_shared_memory_region(region.handle, [a, b])
    inputs = []
    for i, name in enumerate(("INPUT0", "INPUT1")):
        tensor = m.InferInput(name, list(a.shape), "FP32")
        offset, size = spans.get(name, (i * nbytes, nbytes))
        tensor.set_shared_memory(region.name, size, offset=offset)
        inputs.append(tensor)
    outputs = []
    for i, name in enumerate(("OUTPUT0", "OUTPUT1")):
        out = m.InferRequestedOutput(name)
        offset, size = spans.get(name, ((2 + i) * nbytes, nbytes))
        out.set_shared_memory(region.name, size, offset=offset)
        outputs.append(out)
    result = client.infer("adder", inputs, outputs=outputs)
    got = []
    for i, name in enumerate(("OUTPUT0", "OUTPUT1")):
        output = result.get_output(name)
        assert output is not None, name
        got.append(
            shm.get_contents_as_numpy(region.handle, np.float32, a.shape, offset=(2 + i) * nbytes)
        )
    return got


def assert_idle(server, protocol: str) -> None:
    """Idle again once the clients stop: no region left registered, nothing queued."""
    client = client_of(server, protocol)
    try:
        status = client.get_system_shared_memory_status(headers=token_headers(protocol))
        assert len(status.regions if protocol == "grpc" else status) == 0, status
    finally:
        client.close()
    samples = scrape(server.config.server.metrics_url)
    labels = {"model": "adder", "version": "1"}
    assert ("nv_inference_pending_request_count", frozenset(labels.items())) in samples
    assert sample(samples, "nv_inference_pending_request_count", **labels) == 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_eight_clients_infer_through_their_own_regions(server, protocol):
    """Each client registers its region, then sends 20 infers whose inputs and outputs all
    lie in it; every answer is its own inputs' sum and difference."""

    def work(i: int) -> None:
        client = client_of(server, protocol)
        region = Region(client, protocol)
        try:
            rng = np.random.default_rng(i)
            for _ in range(20):
                a = rng.standard_normal((2, ROW)).astype(np.float32)
                b = rng.standard_normal((2, ROW)).astype(np.float32)
                total, difference = shm_infer(client, protocol, region, a, b)
                np.testing.assert_allclose(total, a + b, rtol=1e-6)
                np.testing.assert_allclose(difference, a - b, rtol=1e-6)
        finally:
            region.close()
            client.close()

    each_client(work)
    assert_idle(server, protocol)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_servekits_client_and_bench_take_the_outputs_through_the_region_too(server, protocol):
    """As perf_analyzer's ``--shared-memory``: ``Client.prepare_in_region`` places the
    inputs and, after them, every output of an earlier answer; the server writes the
    outputs there (none come over the socket) and ``outputs_in_region`` reads them back.
    ``servekit bench --shared-memory`` sends such requests, without an error."""
    import asyncio

    from servekit.bench import MeasureConfig, closed_loop, open_target
    from servekit.client import AsyncClient, Client

    urls = server.config.server
    url = urls.http_url if protocol == "http" else urls.grpc_url
    rng = np.random.default_rng(5)
    x = {n: rng.standard_normal((3, ROW)).astype(np.float32) for n in ("INPUT0", "INPUT1")}
    with Client(url) as plain, pytest.raises(ValueError, match="needs a client made with"):
        plain.prepare_in_region(x, x)
    with Client(url, shared_memory=True, access_token=TOKEN) as client:
        with pytest.raises(ValueError, match="no outputs placed"):
            client.outputs_in_region()
        want = client.infer("adder", x)
        inputs, outputs = client.prepare_in_region(x, want)

        async def once() -> dict:
            async with AsyncClient(url) as other:
                return await other.infer_prepared("adder", inputs, outputs=outputs)

        assert asyncio.run(once()) == {}  # nothing came over the socket
        got = client.outputs_in_region()
        np.testing.assert_allclose(got["OUTPUT0"], x["INPUT0"] + x["INPUT1"], rtol=1e-6)
        np.testing.assert_allclose(got["OUTPUT1"], x["INPUT0"] - x["INPUT1"], rtol=1e-6)

    async def bench():
        target = open_target(url, "adder", x, shared_memory="system", access_token=TOKEN)
        try:
            return await closed_loop(
                target, 8, MeasureConfig(window_s=0.5, warmup_s=0.1, max_windows=3, stability=1)
            )
        finally:
            await target.close()

    point = asyncio.run(bench())  # eight clients writing their outputs into one region
    assert point.stats.requests > 0 and point.stats.errors == 0
    assert_idle(server, protocol)  # the bench's region too is unregistered


@pytest.mark.parametrize("prefix", ["r", "r%41 "], ids=["plain", "percent-and-space"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_status_lists_a_region_until_it_is_unregistered(server, protocol, prefix, request):
    """A region is known by the name it was registered with, even one that needs quoting
    in a URL (decoded once: 'r%41 x' is not 'rA x')."""
    if prefix != "r" and protocol == "http" and server.config.runtime != "native":
        reason = "tritonserver keeps a region name's URL quoting ('r%2541%20x' for 'r%41 x')"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    client = client_of(server, protocol)
    region = Region(client, protocol, prefix=prefix)
    try:
        a = np.arange(2 * 16, dtype=np.float32).reshape(2, 16)
        total, difference = shm_infer(client, protocol, region, a, a)
        assert np.array_equal(total, 2 * a) and not difference.any()
        status = client.get_system_shared_memory_status(
            region.name, headers=token_headers(protocol)
        )
        if protocol == "grpc":
            status = [
                {"name": n, "key": r.key, "byte_size": r.byte_size}
                for n, r in status.regions.items()
            ]
        assert [(s["name"], s["key"], int(s["byte_size"])) for s in status] == [
            (region.name, region.key, region.size)
        ]
    finally:
        region.close()
    everything = client.get_system_shared_memory_status(headers=token_headers(protocol))
    names = list(everything.regions) if protocol == "grpc" else [s["name"] for s in everything]
    assert region.name not in names
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_shared_memory_where_no_gpu_serves_it_is_refused_by_name(server, protocol):
    if cuda_refusal(SharedMemory()) is None:
        pytest.skip("this host has a GPU: test_cuda_shared_memory serves it")
    client = client_of(server, protocol)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.register_cuda_shared_memory(
                "gpu_region", b"\x00" * 64, 0, 1024, headers=token_headers(protocol)
            )
        said = refused.value.message()
        if server.config.runtime == "native":  # servekit's own words, and why
            assert "CUDA shared memory is not served by this server" in said, said
            assert "no CUDA device here" in said or "cuda-python is not installed" in said, said
        else:  # passed to tritonserver, whose gRPC answer names no CUDA on a CPU build
            print(f"{server.config.runtime} over {protocol}: {said}")
        status = client.get_cuda_shared_memory_status(headers=token_headers(protocol))
        names = list(status.regions) if protocol == "grpc" else [s["name"] for s in status]
        assert "gpu_region" not in names
        # None registered, so none left: an unregister is answered as tritonserver does
        # (perf_analyzer unregisters every CUDA region as it ends, and reports a refusal)
        client.unregister_cuda_shared_memory(headers=token_headers(protocol))
        client.unregister_cuda_shared_memory("gpu_region", headers=token_headers(protocol))
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_registration_needs_the_control_token(server, protocol):
    client = client_of(server, protocol)
    name = f"r{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 256)
    try:
        with pytest.raises(InferenceServerException):
            client.register_system_shared_memory(name, f"/{name}", 256)
        status = client.get_system_shared_memory_status(headers=token_headers(protocol))
        names = list(status.regions) if protocol == "grpc" else [s["name"] for s in status]
        assert name not in names
    finally:
        shm.destroy_shared_memory_region(handle)
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    "case, spans",
    [
        ("too small", {"INPUT0": (0, ROW_BYTES)}),  # one row's bytes for two rows
        ("past the end", {"INPUT1": (4 * 2 * ROW_BYTES - 8, 2 * ROW_BYTES)}),
        ("output too small", {"OUTPUT0": (2 * 2 * ROW_BYTES, ROW_BYTES)}),  # 1 row for 2
        ("unregistered", None),
    ],
)
def test_a_bad_region_is_the_requests_error_and_the_server_goes_on(server, protocol, case, spans):
    client = client_of(server, protocol)
    region = Region(client, protocol)
    a = np.ones((2, ROW), np.float32)
    try:
        if spans is None:
            region.client.unregister_system_shared_memory(
                region.name, headers=token_headers(protocol)
            )
            spans = {}
        with pytest.raises(InferenceServerException) as caught:
            shm_infer(client, protocol, region, a, a, **spans)
        status = str(caught.value.status())
        # Triton's codes: a region nobody registered is not found; a span that does not
        # fit is the request's error.
        expected = (
            ("404", "StatusCode.NOT_FOUND")
            if case == "unregistered"
            else ("400", "StatusCode.INVALID_ARGUMENT")
        )
        assert status == expected[protocol == "grpc"], (status, caught.value)
        message = caught.value.message()
        assert region.name in message or "INPUT" in message or "OUTPUT0" in message, message
        # The server goes on: the same client, its inputs in the request this time.
        m = module(protocol)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = m.InferInput(name, [2, ROW], "FP32")
            tensor.set_data_from_numpy(a)
            inputs.append(tensor)
        assert np.array_equal(client.infer("adder", inputs).as_numpy("OUTPUT0"), a + a)
    finally:
        region.close()
        client.close()


# ---------------------------------------------------------------- SharedMemory in process


@pytest.fixture
def shared(tmp_path):
    regions = SharedMemory(root=str(tmp_path))
    yield regions, tmp_path
    regions.close()


def test_a_tensor_is_read_and_written_at_its_offset(shared):
    regions, root = shared
    data = np.arange(8, dtype=np.float32)
    (root / "k").write_bytes(b"\0" * 16 + data.tobytes() + b"\0" * 32)
    regions.register("r", "/k", 16, 64)
    got = regions.tensor(ShmRef("r", 0, 32), "x", "FP32", [2, 4])
    assert np.array_equal(got, data.reshape(2, 4))
    regions.write(ShmRef("r", 32, 32), "y", (data * 2).tobytes())
    assert (root / "k").read_bytes()[48:80] == (data * 2).tobytes()
    assert regions.status() == [{"name": "r", "key": "/k", "offset": 16, "byte_size": 64}]


def test_an_output_in_a_region_is_answered_as_tritonserver_answers_it(shared):
    """Its name, datatype and shape alone, over HTTP and gRPC (NVIDIA's C++ client reads
    an output's parameters as its binary_data_size, and refused native's answers while
    they named the region); ``binary_data`` beside a region is Triton's 400."""
    import json

    from servekit.grpc.tensors import infer_response
    from servekit.protocol.kserve import decode_request, encode_response

    regions, root = shared
    (root / "k").write_bytes(b"\0" * 32)
    regions.register("r", "/k", 0, 32)
    y = np.arange(4, dtype=np.float32).reshape(1, 4)
    span = {"shared_memory_region": "r", "shared_memory_offset": 16, "shared_memory_byte_size": 16}
    x = {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}
    body = {"inputs": [x], "outputs": [{"name": "y", "parameters": span}, {"name": "z"}]}
    answer, _ = encode_response(
        "m", {"y": y, "z": y}, decode_request(json.dumps(body).encode(), None, regions)
    )
    assert json.loads(answer)["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1, 4]},
        {"name": "z", "datatype": "FP32", "shape": [1, 4], "data": [0.0, 1.0, 2.0, 3.0]},
    ]
    assert (root / "k").read_bytes()[16:] == y.tobytes()
    body["outputs"][0]["parameters"] = {**span, "binary_data": True}
    with pytest.raises(InvalidInput, match="can't set both 'shared_memory_region' and 'bin"):
        decode_request(json.dumps(body).encode(), None, regions)

    request = grpcclient.service_pb2.ModelInferRequest(model_name="m")
    out = request.outputs.add(name="y")
    for key, value in span.items():
        kind = "string_param" if isinstance(value, str) else "int64_param"
        setattr(out.parameters[key], kind, value)
    request.outputs.add(name="z")
    parts = infer_response(request, {"y": y * 2, "z": y}, ["y", "z"], "1", regions)
    response = grpcclient.service_pb2.ModelInferResponse.FromString(parts.SerializeToString())
    assert [dict(o.parameters) for o in response.outputs] == [{}, {}]
    assert list(response.raw_output_contents) == [b"", y.tobytes()]
    assert (root / "k").read_bytes()[16:] == (y * 2).tobytes()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_registration_that_cannot_work_is_the_clients_error(server, protocol):
    """A missing key, one too small, a path or one of the server's own regions: a 400 /
    INVALID_ARGUMENT naming the region on every runtime (tritonserver alone answers a
    missing key with a 500; the front checks first)."""
    client = client_of(server, protocol)
    name = f"r{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 64)
    try:
        for key, size in (
            (f"/missing{name}", 64),
            (f"/{name}", 128),
            ("/../etc/passwd", 8),
            ("/triton_python_backend_shm_region_1", 8),
        ):
            with pytest.raises(InferenceServerException) as caught:
                client.register_system_shared_memory(
                    name, key, size, headers=token_headers(protocol)
                )
            status = str(caught.value.status())
            assert status == ("StatusCode.INVALID_ARGUMENT" if protocol == "grpc" else "400")
            assert name in caught.value.message(), caught.value.message()
    finally:
        shm.destroy_shared_memory_region(handle)
        client.close()


def test_what_a_region_refuses(shared):
    regions, root = shared
    (root / "k").write_bytes(b"\0" * 64)
    (root / "triton_python_backend_shm_region_1").write_bytes(b"\0" * 64)
    os.symlink(root / "k", root / "link")
    regions.register("r", "/k", 0, 64)
    refused = {
        "already registered": lambda: regions.register("r", "/k", 0, 8),
        "past its key": lambda: regions.register("s", "/k", 32, 64),
        "a path": lambda: regions.register("s", "/../k", 0, 8),
        "one of the server's own": lambda: regions.register(
            "s", "/triton_python_backend_shm_region_1", 0, 8
        ),
        "a link": lambda: regions.register("s", "/link", 0, 8),
        "missing": lambda: regions.register("s", "/nothing", 0, 8),
        "too small for the tensor": lambda: regions.tensor(ShmRef("r", 0, 8), "x", "FP32", [4]),
        "past the region": lambda: regions.tensor(ShmRef("r", 60, 16), "x", "FP32", [4]),
        "an output too large": lambda: regions.write(ShmRef("r", 0, 8), "y", b"\0" * 16),
    }
    for why, attempt in refused.items():
        with pytest.raises(InvalidInput):
            attempt()
            pytest.fail(f"not refused: {why}")
    for unknown in (
        lambda: regions.tensor(ShmRef("q", 0, 16), "x", "FP32", [4]),
        lambda: regions.status("q"),
    ):
        with pytest.raises(RegionNotFound):
            unknown()
    regions.unregister("q")  # unknown: no error, as in Triton


def test_an_object_shrunk_after_registration_is_refused_not_a_crash(shared):
    """Reading past a shrunk object's end would be SIGBUS: the server checks first."""
    regions, root = shared
    (root / "k").write_bytes(b"\0" * 4096)
    regions.register("r", "/k", 0, 4096)
    os.truncate(root / "k", 16)
    with pytest.raises(InvalidInput, match="shrank"):
        regions.tensor(ShmRef("r", 0, 64), "x", "FP32", [16])


def test_a_server_without_shared_memory_refuses_it_by_name():
    """Ray's ingress app takes no regions (its replicas may run on other hosts): a
    registration is a 403 saying where shared memory is served, an infer naming a
    region a 400 naming the tensor and the region; the status lists none."""
    import asyncio
    import json

    from servekit import FunctionRunner, ModelSpec, TensorSpec
    from servekit.http import KServeApp
    from servekit.http.messages import HttpRequest

    spec = ModelSpec((TensorSpec("x", np.float32, [1]),), (TensorSpec("y", np.float32, [1]),))
    app = KServeApp({"m": FunctionRunner(lambda inputs: {"y": inputs["x"]}, spec)})

    def call(method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else b""
        return asyncio.run(app.handle(HttpRequest(method, path, {}, data)))

    status, body, _ = call(
        "POST", "/v2/systemsharedmemory/region/r/register", {"key": "/r", "byte_size": 4}
    )
    assert status == 403 and b"native, pytriton and triton" in body
    assert call("GET", "/v2/systemsharedmemory/status")[:2] == (200, b"[]")
    assert call("POST", "/v2/systemsharedmemory/unregister")[0] == 200  # none left
    region = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    request = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "parameters": region}]}
    status, body, _ = call("POST", "/v2/models/m/infer", request)
    assert status == 400 and b"'x'" in body and b"'r'" in body, body
