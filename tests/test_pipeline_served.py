"""One Triton instance that takes its next batch while the device runs one
(``[models] overlap``; by default where the model runs off the host's CPU;
``servekit.triton.pipeline``), served for real on the triton runtime (servekit's
backend) and the pytriton runtime (the stub shim):

- on a simulated device with one configured instance and the default, batches are handed
  over while the one before them is on the device, as the instance's own counter
  (``servekit_batch_overlapped``) shows, not timing; with ``overlap = false`` never; and
  Triton reports the one instance that was configured;
- every answer is each client's own, and a model on the CPU (ONNX Runtime) does not
  overlap by default: eight tritonclients at once get their own sums, each client's
  malformed request is refused alone with a 400, and the model is idle again after.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra")
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import each_client, sample, scrape  # noqa: E402
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.bench.compare import ServerProcess  # noqa: E402
from servekit.metrics import OVERLAP_METRIC  # noqa: E402
from servekit.zoo.tiny import build_simulated  # noqa: E402


@pytest.fixture(scope="module", params=["triton", "pytriton"])
def server(request, add_sub_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("devices")
    devices = []
    for name, overlap in (("on_device", None), ("off_device", False)):
        # 20 ms a batch plus 1 ms a row: far longer than a hand-over on any runtime.
        path = folder / f"{name}.onnx"
        onnx.save(build_simulated(f"{request.param}-{name}", 20_000, 1_000), path)
        batching = BatchingPolicy(max_batch_size=8)
        devices.append(ModelConfig(str(path), name, batching=batching, overlap=overlap))
    adder = ModelConfig(
        str(add_sub_path), "adder", threads=1,
        batching=BatchingPolicy(max_batch_size=8, max_queue_delay_us=200),
    )  # fmt: skip
    config = ServeConfig(
        (adder, *devices), ServerConfig(exit_timeout_s=2), runtime=request.param
    ).on_loopback()
    with ServerProcess(config) as served:
        served.wait_ready(["adder", "on_device", "off_device"])
        yield served


def tensors(*values: np.ndarray) -> list:
    out = []
    for i, value in enumerate(values):
        tensor = httpclient.InferInput(f"INPUT{i}", list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def client_of(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.config.server.http_url.split("//")[-1])


def test_eight_clients_get_their_own_answers_and_a_bad_request_fails_alone(server):
    def work(k: int) -> None:
        client = client_of(server)
        rng = np.random.default_rng(k)
        try:
            for i in range(30):
                if i == 11:
                    with pytest.raises(InferenceServerException) as caught:
                        client.infer("adder", tensors(np.ones((1, 3), np.float32),
                                                      np.ones((1, 3), np.float32)))  # fmt: skip
                    assert caught.value.status() == "400", caught.value
                    continue
                a = rng.standard_normal((1, 16)).astype(np.float32)
                b = rng.standard_normal((1, 16)).astype(np.float32)
                result = client.infer("adder", tensors(a, b))
                np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
                np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
        finally:
            client.close()

    each_client(work)
    # Idle again once they stop: nothing queued for the model, every batch answered.
    samples = scrape(server.config.server.metrics_url)
    labels = {"model": "adder", "version": "1"}
    assert ("nv_inference_pending_request_count", frozenset(labels.items())) in samples
    assert sample(samples, "nv_inference_pending_request_count", **labels) == 0
    assert sample(samples, "nv_inference_request_success", **labels) >= 8 * 29
    assert sample(samples, OVERLAP_METRIC, **labels) == 0  # on the CPU: answered in execute


@pytest.mark.parametrize(("model", "overlaps"), [("on_device", True), ("off_device", False)])
def test_one_instance_takes_the_next_batch_while_the_device_runs_one(server, model, overlaps):
    def work(k: int) -> None:
        client = client_of(server)
        try:
            for i in range(12):
                x = np.full((1, 16), k * 100 + i, np.float32)
                result = client.infer(model, tensors(x))
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0").shape, (1, 16))
        finally:
            client.close()

    each_client(work)
    samples = scrape(server.config.server.metrics_url)
    labels = {"model": model, "version": "1"}
    assert sample(samples, "nv_inference_request_success", **labels) == 8 * 12
    assert sample(samples, "nv_inference_pending_request_count", **labels) == 0
    handed_over = sample(samples, OVERLAP_METRIC, **labels)
    if overlaps:
        # Eight clients keep a batch waiting behind nearly every one on the device.
        assert handed_over >= 3, f"{handed_over} batches overlapped with one instance"
    else:
        assert handed_over == 0
    client = client_of(server)
    try:
        (group,) = client.get_model_config(model)["instance_group"]
        assert group["count"] == 1
    finally:
        client.close()
