"""The pipelined instance (``SERVEKIT_PIPELINE_DEPTH`` > 1) served for real: on the
triton runtime (servekit's backend) and the pytriton runtime (the stub shim), eight
tritonclients at once each get their own sums back, each client's malformed request is
refused alone with a 400 while the rest of its batch is answered, and the model is idle
again once they stop."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra")
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import each_client, sample, scrape  # noqa: E402
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.bench.compare import ServerProcess  # noqa: E402


@pytest.fixture(scope="module", params=["triton", "pytriton"])
def server(request, add_sub_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVEKIT_PIPELINE_DEPTH", "3")
        config = ServeConfig(
            (
                ModelConfig(
                    str(add_sub_path), "adder", threads=1,
                    batching=BatchingPolicy(max_batch_size=8, max_queue_delay_us=200),
                ),
            ),
            ServerConfig(exit_timeout_s=2),
            runtime=request.param,
        ).on_loopback()  # fmt: skip
        with ServerProcess(config) as served:
            served.wait_ready(["adder"])
            yield served


def tensors(a: np.ndarray, b: np.ndarray) -> list:
    out = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = httpclient.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def test_eight_clients_get_their_own_answers_and_a_bad_request_fails_alone(server):
    def work(k: int) -> None:
        client = httpclient.InferenceServerClient(server.config.server.http_url.split("//")[-1])
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
