"""``[ray] fuse``: models served inside the ingress replicas, one deployment, no handle
call per batch (an image classifier's stages too); the same protocol, batching and errors
as the chained app."""

from __future__ import annotations

import threading
import urllib.request

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("tritonclient.http")

import tritonclient.http as httpclient  # noqa: E402

from conftest import each_client, parse_metrics, ray_serve, sample  # noqa: E402
from servekit import InvalidInput, OnnxRuntimeRunner, image_classifier, zoo  # noqa: E402
from servekit.client import Client  # noqa: E402
from servekit.ray import build_app  # noqa: E402
from servekit.stages import synthetic_image  # noqa: E402

BATCHING = {"max_batch_size": 8, "max_queue_delay_us": 500}
CONFIG = {
    "models": [
        {"source": "add_sub", "instances": 2, "batching": BATCHING},
        {"source": str(zoo.resolve("tiny_cnn")), "name": "tiny_cnn", "batching": BATCHING},
    ],
    "ray": {"model_cpus": 0.5, "fuse": True},
}


@pytest.fixture(scope="module")
def fused_url():
    with ray_serve() as url:
        serve.run(build_app(CONFIG), name="servekit", route_prefix="/")
        with Client(url) as c:
            c.wait_ready("add_sub", timeout_s=120)
        yield url


def test_the_fused_app_is_one_deployment_of_instances_replicas(fused_url):
    deployments = serve.status().applications["servekit"].deployments
    assert list(deployments) == ["Ingress"]
    assert sum(deployments["Ingress"].replica_states.values()) == 2


def test_concurrent_tritonclient_requests_each_get_their_own_answer(fused_url):
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(16)]
    got: dict[int, dict[str, np.ndarray]] = {}

    def one(i: int) -> None:
        client = httpclient.InferenceServerClient(fused_url.removeprefix("http://"))
        inputs = []
        for name, value in (("INPUT0", rows[i]), ("INPUT1", rows[i] * 2)):
            tensor = httpclient.InferInput(name, [1, 16], "FP32")
            tensor.set_data_from_numpy(value, binary_data=i % 2 == 0)
            inputs.append(tensor)
        answer = client.infer("add_sub", inputs)
        got[i] = {n: answer.as_numpy(n) for n in ("OUTPUT0", "OUTPUT1")}
        client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(rows):
        np.testing.assert_allclose(got[i]["OUTPUT0"], x * 3, rtol=1e-6)
        np.testing.assert_allclose(got[i]["OUTPUT1"], -x, rtol=1e-6)


def test_a_bad_tensor_is_a_400_naming_it(fused_url):
    with Client(fused_url) as c, pytest.raises(InvalidInput, match="INPUT0"):
        c.infer(
            "add_sub",
            {"INPUT0": np.zeros((1, 15), np.float32), "INPUT1": np.zeros((1, 16), np.float32)},
        )


def test_an_image_classifier_is_served_in_the_ingress_as_the_in_process_pipeline(fused_url):
    """Eight clients at once, each with images of its own and one that is not an image:
    each gets the in-process pipeline's answers, the bad image is a 400 naming the input
    alone, and nothing is left pending after."""
    images = [synthetic_image(i) for i in range(16)]
    local = image_classifier(OnnxRuntimeRunner(zoo.resolve("tiny_cnn")))
    try:
        expected = local.classify(images)
    finally:
        local.close()

    def work(k: int) -> None:
        with Client(fused_url) as c:
            mine = [2 * k, 2 * k + 1]
            for i in mine:
                assert c.classify([images[i]], model="tiny_cnn_image") == [expected[i]]
            with pytest.raises(InvalidInput, match="input 'image' row 0: cannot decode"):
                c.classify([b"not an image"], model="tiny_cnn_image")
            assert c.classify([images[i] for i in mine], model="tiny_cnn_image") == [
                expected[i] for i in mine
            ]

    each_client(work)
    assert list(serve.status().applications["servekit"].deployments) == ["Ingress"]
    with urllib.request.urlopen(f"{fused_url}/metrics", timeout=10) as r:
        samples = parse_metrics(r.read().decode())
    labels = {"model": "tiny_cnn_image", "version": "1"}
    assert sample(samples, "nv_inference_pending_request_count", **labels) == 0
